"""Per-size kernels for the buckets that serve calls, compiled and swapped in the background.

With ``compile=True`` one compile, dynamic in the batch dimension, serves every bucket: the
start is fast, but shape-generic kernels can be slower than kernels compiled for one shape
(Inductor leaves convolutions in their default layout when the batch is dynamic, and some
passes run only on static shapes). The tuner closes that gap where it matters: once a bucket
has served ``HOT_CALLS`` calls, the engine's worker takes the bucket that has served the most
rows among the hot ones, compiles kernels for its shape, captures them, times the new graph
against a graph of the shared kernels (replays alone, interleaved, medians), and keeps the new
one only if it is at least ``1 - GAIN`` faster. Calls are served all the while, by the shared
kernels until the swap. Each bucket is tuned once.
"""

import logging
import statistics
import time
from typing import Callable, Iterable, Optional, Tuple

from ..core.records import Bucket, Serves
from ..core.stats import counts_of
from .compiled import CompiledForward, static_options
from .racing import time_turns
from .work import capture_into, save_compile_cache, swap

logger = logging.getLogger("graphwrap")
HOT_CALLS = 16  # calls a bucket serves before its own kernels are worth a compile
GAIN = 0.97  # the per-size graph is kept if it replays in at most this share of the time


def hottest(candidates: Iterable[Tuple[int, int, object]], hot_calls: Optional[int] = None):
    """The item of ``(rows, calls, item)`` with the most rows among those with at least
    ``hot_calls`` (default ``HOT_CALLS``) calls; None if there is none."""
    hot_calls = HOT_CALLS if hot_calls is None else hot_calls
    best = None
    for rows, calls, item in candidates:
        if calls >= hot_calls and (best is None or rows > best[0]):
            best = (rows, item)
    return None if best is None else best[1]


def keep_new(old_s: float, new_s: float, gain: Optional[float] = None) -> bool:
    """Whether a graph that replays in ``new_s`` replaces one that replays in ``old_s``."""
    return new_s <= (GAIN if gain is None else gain) * old_s


def time_replays(old: Callable[[], None], new: Callable[[], None], timed, rounds: int = 7,
                 round_s: float = 2e-3) -> Tuple[float, float]:
    """Seconds per replay of ``old`` and ``new``, in turns round by round; medians. ``timed(fn,
    k)`` times ``fn(k)`` (k calls)."""
    def loop(fn):
        def run(k):
            for _ in range(k):
                fn()
        return lambda k: timed(run, k)

    old_s, new_s = time_turns([loop(old), loop(new)], rounds, round_s, keep=statistics.median)
    return old_s, new_s


def candidates(engine):
    """``(rows, calls, (key, bucket))`` of each bucket that runs shared compiled kernels and was
    not tuned yet. The caller holds the engine's lock."""
    out = []
    for ks in engine.store.keys.values():
        if ks.failed is not None or ks.fixed:
            continue  # a state input: its tuning would capture and time the step beside the calls that write it
        counts = None
        for b in ks.buckets.values():
            if b.graphs and b.compiled and b.kernels == "shared" and not b.tuned and b.serves is Serves.GRAPH:
                counts = counts or counts_of(ks)
                c = counts[id(b)]
                out.append((c[1], c[0], (ks, b)))
    return out


def tune_next(engine):
    """A worker job: give the hottest untuned bucket kernels of its own shape, where faster."""
    with engine.lock:
        if engine.compile_opts is None or engine.capturer.compile_off is not None or engine.capturer.writes is not None:
            return  # a module that writes its buffers is not timed beside the calls that write them
        job = hottest(candidates(engine))
        if job is None:
            return
        ks, old = job
        old.tuned = True  # once, whatever comes of it
        if engine.capturer.static_forward is None:
            engine.capturer.static_forward = CompiledForward(engine.module, static_options(engine.compile_opts))
        forward, epoch = engine.capturer.static_forward, engine.epoch
        sample = [t.clone() for t in old.graphs[0].static_inputs]
    try:
        _tune(engine, ks, old, forward, epoch, sample)
    except Exception as e:  # noqa: BLE001 - reported in stats(); calls go on with the shared kernels
        engine.capturer.tuning_error = f"{type(e).__name__}: {e}"
        logger.warning("tuning bucket %d of %s stopped: %s", old.size, ks.label, engine.capturer.tuning_error)


def _tune(engine, ks, old: Bucket, forward, epoch: int, sample):
    t0 = time.perf_counter()
    new = Bucket(old.size, old.seq, tuned=True)
    if capture_into(engine, ks, new, sample, old.size, old.seq, forward=forward, timed=False) is None:
        return
    if not new.compiled:
        logger.warning("per-size kernels for bucket %d of %s: torch.compile compiled nothing; it keeps "
                       "the shared kernels", old.size, ks.label)
        return
    # The shared kernels timed on a graph of their own: the one serving gm(...) must not be
    # replayed here, it would overwrite outputs a caller may hold (outputs="view").
    shared = Bucket(old.size, old.seq)
    if capture_into(engine, ks, shared, sample, old.size, old.seq, forward=old.forward, timed=False) is None:
        return
    device = ks.device

    def replay(g):
        def run():
            with engine.lock:
                if device.type == "cuda":
                    engine.order_stream(device)
                g.replay()
        return run

    shared_s, per_size_s = time_replays(replay(shared.graphs[0]), replay(new.graphs[0]), engine.backend.timed)
    del shared
    with engine.lock:
        if engine.epoch != epoch or ks.buckets.get(old.point) is not old or ks.failed is not None:
            return
        for b in (old, new):
            b.shared_us, b.per_size_us = 1e6 * shared_s, 1e6 * per_size_s
        kept = keep_new(shared_s, per_size_s)
        if kept:
            swap(engine, ks, old, new)
    logger.info("bucket %d of %s: per-size kernels replay in %.1f us, the shared ones in %.1f us; keeps "
                "the %s (tuned in %.1f s)", old.size, ks.label, 1e6 * per_size_s, 1e6 * shared_s,
                "per-size kernels" if kept else "shared kernels", time.perf_counter() - t0)
    if kept:
        save_compile_cache(engine)


def pending(engine) -> bool:
    """Whether a hot bucket waits for its per-size kernels."""
    with engine.lock:
        return (engine.capturer.compile_off is None and engine.compile_opts is not None
                and hottest(candidates(engine)) is not None)
