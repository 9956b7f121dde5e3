"""The engine's side of a capture: the job a bucket needs, what a failure means for the key and
the bucket, installing a captured graph, the race against eager, owned-output slots, extra
graphs for loops, the memory budget, and capturing every bucket of a key.

Functions of the engine's records, run by :meth:`Engine._capture` (under the engine's lock where
they say so) and by the worker's jobs.
"""

import contextlib
import logging
import statistics
import time
from typing import Optional

import torch

from ._compat import autocast_without_cache
from .capture import Job
from .checks import CaptureFailed
from .errors import GraphwrapError
from .outputs import ring_for
from .verify import SAME_SHAPE_TOL, compare_leaves
from .plans import Plan
from .records import Bucket, Key, Serves
from .tree import CONST, unflatten_inputs

logger = logging.getLogger("graphwrap")
# A bucket serves its calls eagerly when eager took at most this share of the graph's time.
EAGER_WINS = 0.9  # near a tie, graphs: they also leave the host free, which counts under load


@contextlib.contextmanager
def _guarded(engine, device):
    """Replays of graphs of the engine's pool: under its lock, on a stream ordered after the
    last call's work (graphs of one pool share memory: no two may run at once)."""
    with engine.lock:
        if device.type == "cuda":
            engine.order_stream(device)
        yield


def make_job(engine, ks: Key, b: Bucket, leaves, n: int, L, plain: bool, forward) -> Job:
    """The capture job of bucket ``b``, sampled from the call's real rows (copied: the caller's
    tensors are never touched). The caller holds the lock."""
    store, device = engine.store, ks.device
    if engine.weights.ptrs is None:
        engine.weights.record()
    m = min(n, b.size)
    real = [(t if bd is None else t.narrow(bd, 0, m)).to(device, copy=True) for t, (bd, _, _) in zip(leaves, ks.roles)]
    budget = budget_left(engine)
    if b.size > engine.grid.top(b.seq) and device.type == "cuda":
        budget = _large_budget(device, budget)
    compiled = forward if forward is not None else None if plain else engine.compiled_forward()
    names = engine.decl.names(ks.spec)
    # The first capture of a signature warms up fully (cuBLAS, cuDNN and Triton set-up, autotuning);
    # later buckets of it need one run to settle their own shapes.
    warmup = engine.opts.warmup_iters if ks.kinds is None or compiled is not None else 1
    return Job(engine.module, compiled, device, store.pool, ks.spec, ks.roles, engine.batch_dim, real, b.size, b.seq,
               warmup, ks.autocast, engine.verify, ks.kinds, ks.seq_dims, ks.out_spec, budget,
               guard=lambda: _guarded(engine, device), describe=names.__getitem__, pad_check=ks.exact is None)


def settle_failure(engine, ks: Key, b: Bucket, e: CaptureFailed, epoch: int, forward, may_evict: bool = True
                   ) -> Optional[str]:
    """Record a failed capture; "plain" to capture the plain forward instead, "again" to try
    once more (memory was made), None to stop. The caller holds the lock."""
    if engine.epoch != epoch:
        b.serves = Serves.NOTHING
        return None
    if e.pool_lost:
        engine.store.pool = None  # graphs already in it keep their memory; new ones get a new pool
    if ks.buckets.get(b.point) is not b:  # a graph beside the served one: compiled, tuned, leased
        if e.scope == "compile" and forward is not engine.static_forward:
            engine.give_up_compile(e.reason)
        else:
            logger.warning("graphwrap: a further graph of bucket %s of %s was not captured (%s); the bucket goes on "
                           "as it was", _name(b), ks.label, e.reason)
        return None
    if e.scope == "compile":
        engine.give_up_compile(e.reason)
        return "plain"
    if e.scope == "seq" and ks.exact is None:
        ks.exact = e.reason
        ks.buckets.pop(b.point, None)
        fold(engine, ks, None)
        b.serves = Serves.NOTHING
        logger.warning("graphwrap: lengths of %s are not padded (%s); graphs are captured for each exact length",
                       ks.label, e.reason)
        return None
    if e.scope == "budget":
        if may_evict and drop_least_used(engine, e.pool_estimate, b):
            return "again"
        b.serves, b.reason, b.pool_estimate = Serves.OVER_BUDGET, e.reason, e.pool_estimate
        where = "are chunked or run eagerly" if b.size > engine.grid.top(b.seq) else "go to the next larger captured bucket"
        engine.log_once(("budget", ks.label, b.point), logging.INFO,
                        f"graphwrap: bucket {_name(b)} of {ks.label} not captured: {e.reason}; its batches {where}")
        return None
    b.serves, b.reason = Serves.FAILED, e.reason
    if e.scope != "bucket":
        ks.fail(e.reason)
        for shape, p in list(engine.fast.items()):
            if p.key is ks:
                del engine.fast[shape]
    msg = f"graphwrap: capture of bucket {_name(b)} for {ks.label} failed: {e.reason}"
    if engine.fallback == "raise":
        raise GraphwrapError(f"{msg}. Pass fallback=\"eager\" to run such inputs eagerly instead") from (e.cause or e)
    engine.log_once(("capture", ks.label, b.point if e.scope == "bucket" else None), logging.WARNING,
                    f"{msg}; running {'this bucket' if e.scope == 'bucket' else 'these inputs'} eagerly")
    return None


def _name(b: Bucket) -> str:
    return str(b.size) if b.seq is None else f"{b.size}x{b.seq}"


def install(engine, ks: Key, b: Bucket, got, compiled, ring):
    """A captured graph joins its bucket, which serves by graph from now on. The caller holds the lock."""
    ks.kinds, ks.seq_dims, ks.out_spec = got.kinds, got.seq_dims, got.out_spec
    if got.pool is not None:
        engine.store.pool = got.pool  # captured again in a new pool (see CudaRecorder.record)
    g = got.graph
    g.ring = ring
    b.graphs.append(g)
    b.serves, b.reason = Serves.GRAPH, None
    b.capture_s += got.capture_s
    b.verify_s += got.verify_s
    b.pool_bytes += got.pool_bytes
    b.pool_estimate = max(b.pool_estimate, got.pool_estimate)
    b.compile_s += got.compile_s
    b.compiled_graphs += got.compiled_graphs
    _mark_compiled(engine, ks, b, compiled, got.compiled_graphs)
    if compiled is not None:
        how = (f"compiled, {got.compiled_graphs} graphs in {got.compile_s:.2f} s" if b.compiled
               else "NOT compiled: torch.compile compiled nothing for this shape")
        level = logging.INFO if b.compiled else logging.WARNING
    else:
        how, level = "plain forward", logging.INFO
    logger.log(level, "graphwrap: captured bucket %s of %s in %.1f ms (%s; verify %.1f ms), graph pool +%.1f MiB",
               _name(b), ks.label, 1e3 * got.capture_s, how, 1e3 * got.verify_s, got.pool_bytes / 2**20)


def _mark_compiled(engine, ks: Key, b: Bucket, compiled, graphs: int):
    b.forward = compiled
    if compiled is None:
        b.compiled = False if engine.compile_opts is not None else None
        return
    b.kernels = "shared" if compiled.dynamic else "per-size"
    # Compiled kernels ran if this warm-up compiled a graph, or this shape (any shape, with
    # dynamic shapes) was compiled before, by this key or one whose static inputs look the
    # same (dynamo's cache outlives reset()): otherwise dynamo ran the forward uncompiled.
    seen = compiled.shapes
    ran = (graphs > 0 or (ks.seen_as, b.point) in seen
           or (compiled.dynamic and any(label == ks.seen_as for label, _ in seen)))
    if ran:
        seen.add((ks.seen_as, b.point))
    b.compiled = ran if b.compiled is None else (b.compiled and ran)


def ring_of(engine, ks: Key, got):
    """The owned-output ring of a captured graph, with its first slot (its fill is a capture:
    made here, off the call path); None where outputs are better cloned."""
    g = got.graph
    pool = got.pool if got.pool is not None else engine.store.pool
    ring = ring_for(g.static_outputs, g.kinds, engine.batch_dim,
                    engine.backend.slot_maker(ks.device, pool, g.run, g.draws, g.kinds), g.seq_dims)
    if ring is not None:
        slot = _checked_slot(engine, ks.device, g, ring, warm=False)  # this thread just warmed up
        if slot is not None:
            ring.add(slot)
    return ring


def _checked_slot(engine, device, g, ring, warm: bool = True):
    """A new slot of ``g``'s ring whose fill gives what the graph gives on the same inputs; None
    (counted as a failure of the ring) otherwise."""
    slot = ring.make(warm)
    if slot is None:
        if getattr(ring.error, "pool_lost", False):
            with engine.lock:
                engine.store.pool = None  # later captures go to a new pool
        return None
    with _guarded(engine, device):
        g.replay()
        want = [o.clone() for o, k in zip(g.static_outputs, g.kinds) if k != CONST]
        slot.fill()
        got = [b.clone() for b in slot.bases]
    msg = compare_leaves(got, want, SAME_SHAPE_TOL)
    if msg:
        ring.failures += 1
        logger.warning("graphwrap: an owned-output graph differs from its bucket's graph (%s); outputs are cloned", msg)
        return None
    return slot


def add_slot(engine, graph, epoch: int):
    """A worker job: one more owned-output slot for ``graph``, whose slots were all held."""
    slot = _checked_slot(engine, graph.static_inputs[0].device, graph, graph.ring) if engine.epoch == epoch else None
    with engine.lock:
        graph.ring.wanted = graph.ring.growing = False
        if slot is not None and engine.epoch == epoch:
            graph.ring.add(slot)


def add_graph(engine, ks: Key, b: Bucket) -> Optional[int]:
    """One more graph of a served bucket (for a loop's lease), sampled from the first graph's
    static inputs; its index, or None."""
    with engine.lock:
        if not b.graphs or b.serves is not Serves.GRAPH:
            return None
        sample = [t.clone() for t in b.graphs[0].static_inputs]
        forward, plain = (b.forward, False) if b.compiled else (None, True)
    extra = Bucket(b.size, b.seq)
    if engine._capture(ks, extra, sample, b.size, None, forward=forward, plain=plain, timed=False) is None:
        return None
    with engine.lock:
        if ks.buckets.get(b.point) is not b or b.serves is not Serves.GRAPH:
            return None
        b.graphs.append(extra.graphs[0])
        b.pool_bytes += extra.pool_bytes
        return len(b.graphs) - 1


# ---------------------------------------------------------------------------------- timing


def time_pair(a_calls, b_calls, rounds: int, round_s: float, stop_early=None, timed=None):
    """Seconds per call of ``a_calls(k)`` and ``b_calls(k)`` (each makes ``k`` calls), timed in
    turns round by round with ``timed(fn, k)``; medians over the rounds. ``k`` makes a round
    last about ``round_s``; ``stop_early(a_s, b_s)``, if given, may end after the first round."""
    once = max(timed(a_calls, 1), timed(b_calls, 1))
    k = max(1, min(64, int(round_s / max(once, 1e-6))))
    xs, ys = [], []
    for r in range(rounds):
        xs.append(timed(a_calls, k))
        ys.append(timed(b_calls, k))
        if r == 0 and stop_early is not None and stop_early(xs[0], ys[0]):
            break
    return statistics.median(xs), statistics.median(ys)


class _Dropped(Exception):
    pass


def race(engine, ks: Key, b: Bucket, rounds: int = 5, round_s: float = 2e-3):
    """Time this bucket's calls through its graph, as ``gm(...)`` makes them (copy in, replay,
    owned outputs), against eager on the same inputs; serve it eagerly if eager is faster.

    A round of graph calls is issued under the lock, its clock started once the lock is held
    (waiting for other callers is not the graph's cost); the waits for the device are outside
    it. The best round of each counts: other work on the host or device only ever slows one.
    """
    with engine.lock:
        if not b.graphs:
            return
        plan = Plan(engine, ks, b.size, b.seq, b)
        leaves = [t.clone() for t in b.graphs[0].static_inputs]
    device = ks.device
    sync = engine.backend.sync
    args, kwargs = unflatten_inputs(ks.spec, leaves)

    def graph_round(k):
        sync()
        with engine.lock:
            if plan.epoch != engine.epoch or not b.graphs:
                raise _Dropped
            t0 = time.perf_counter()
            if device.type == "cuda":
                engine.order_stream(device)
            for _ in range(k):
                plan.run(leaves)
        sync()
        return (time.perf_counter() - t0) / k

    def eager_round(k):
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode(False), torch.no_grad(), autocast_without_cache(ks.autocast):
            for _ in range(k):
                engine.module(*args, **kwargs)
        sync()
        return (time.perf_counter() - t0) / k

    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            once = max(graph_round(1), eager_round(1))
            k = max(1, min(64, int(round_s / max(once, 1e-6))))
            graph_s, eager_s = graph_round(k), eager_round(k)
            for _ in range(rounds - 1):
                if 2 * graph_s <= eager_s:
                    break
                graph_s, eager_s = min(graph_s, graph_round(k)), min(eager_s, eager_round(k))
    except _Dropped:
        return
    with engine.lock:
        b.graph_us, b.eager_us = 1e6 * graph_s, 1e6 * eager_s
        if eager_s <= EAGER_WINS * graph_s and b.serves is Serves.GRAPH:
            b.serves = Serves.EAGER
            fold(engine, ks, b)
            logger.info("graphwrap: bucket %s of %s runs eagerly: eager took %.1f us a call, the graph %.1f us",
                        _name(b), ks.label, b.eager_us, b.graph_us)


def fold(engine, ks: Key, b: Optional[Bucket]):
    """Drop the plans of bucket ``b`` (every plan of ``ks`` if None), their counts kept in
    their buckets; plans are made again on the next calls. The caller holds the lock."""
    for key, plan in list(ks.plans.items()):
        if b is not None and plan.bucket is not b:
            continue
        pb = plan.bucket
        if plan.calls and pb.size:
            if plan.eager:
                pb.eager_calls += plan.calls
            else:
                pb.replays += plan.calls
                pb.rows += plan.calls * plan.n
                pb.padded_rows += plan.calls * (pb.size - plan.n)
                if plan.L is not None:
                    pb.tokens += plan.calls * plan.n * plan.L
                    pb.padded_tokens += plan.calls * (pb.size * pb.seq - plan.n * plan.L)
        del ks.plans[key]
    for shape, plan in list(engine.fast.items()):
        if plan.key is ks and (b is None or plan.bucket is b):
            del engine.fast[shape]


def swap(engine, ks: Key, old: Bucket, new: Bucket):
    """``new`` serves ``old``'s batches from the next call, with its counts; plans are rebuilt
    (loops holding the old graphs go on replaying them). The caller holds the lock."""
    fold(engine, ks, old)
    # The old graphs' memory stays in the pool (for later captures): still counted here.
    new.pool_bytes += old.pool_bytes
    new.capture_s += old.capture_s
    new.compile_s += old.compile_s
    for name in ("replays", "rows", "padded_rows", "tokens", "padded_tokens", "eager_calls"):
        setattr(new, name, getattr(new, name) + getattr(old, name))
    ks.buckets[old.point] = new


# ---------------------------------------------------------------------------------- memory budget


def budget_left(engine) -> Optional[int]:
    budget = engine.opts.max_pool_bytes
    if budget is None:
        return None
    return budget - sum(_held(b) for ks in engine.store.keys.values() for b in ks.buckets.values())


def _held(b: Bucket) -> int:
    """What a bucket's graphs added to the pool (its growth when they were captured)."""
    return b.pool_bytes if b.graphs else 0


def _large_budget(device, budget: Optional[int]) -> int:
    """Pool growth allowed for a bucket above the largest: at most half the device memory that
    is free or cached unused, and within ``max_pool_bytes``."""
    free = torch.cuda.mem_get_info(device)[0]
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free // 2 if budget is None else min(budget, free // 2)


def drop_least_used(engine, need: int, keep: Bucket) -> bool:
    """Make room for ``need`` bytes of graph pool under ``max_pool_bytes`` by dropping the graphs
    of the least used buckets (captured again when needed); whether it fits now. The caller
    holds the lock; the dropped graphs are freed after the device is done with them."""
    budget = engine.opts.max_pool_bytes
    if budget is None or need > budget:
        return False
    live = []
    for ks in engine.store.keys.values():
        for b in ks.buckets.values():
            if b.graphs and b is not keep and not b.leased and b.serves in (Serves.GRAPH, Serves.EAGER):
                calls = sum(p.calls for p in ks.plans.values() if p.bucket is b) + b.replays + b.eager_calls
                live.append((calls, b.size * (b.seq or 1), ks, b))
    live.sort(key=lambda t: (t[0], t[1]))
    left = budget_left(engine)
    taken = []
    for _, _, ks, b in live:
        if left >= need:
            break
        left += _held(b)
        taken.append((ks, b))
    if left < need:
        return False
    for ks, b in taken:
        fold(engine, ks, b)
        engine.dropped.extend(b.graphs)
        b.graphs = []
        b.serves = Serves.NOTHING
        logger.info("graphwrap: bucket %s of %s dropped for max_pool_bytes (least used); captured again when needed",
                    _name(b), ks.label)
    return True


def release_dropped(engine, device):
    """Free evicted graphs once the device is done with their last replays."""
    with engine.lock:
        dropped, engine.dropped = engine.dropped, []
    if dropped:
        engine.backend.sync(device)
        del dropped


# ---------------------------------------------------------------------------------- every bucket


def capture_all(engine, ks: Key, sample, n: int, L, background: bool) -> dict:
    """Capture every bucket of ``ks``, largest first, with ``sample`` (the plain forward first
    when ``background``, then the compiled one bucket by bucket); the key's stats."""
    from .stats import key_stats

    t0 = time.perf_counter()
    try:
        done = _every_bucket(engine, ks, sample, n, L, plain=background)
        if background:
            ks.warming = False
            _compile_each(engine, ks, sample, n, L)
        logger.info("graphwrap: captured %d buckets of %s in %.2f s", done, ks.label, time.perf_counter() - t0)
        engine.save_compile_cache()
    except Exception as e:  # noqa: BLE001 - in the background: reported; calls go on with what was captured
        if not background:
            raise
        logger.warning("graphwrap: background capture of %s stopped: %s: %s", ks.label, type(e).__name__, e)
        engine.background_error = f"{type(e).__name__}: {e}"
    finally:
        ks.warming = False
        if background:
            engine.background_state = "done"
    with engine.lock:
        return key_stats(ks)


def _points(engine, ks: Key, L):
    if not ks.has_seq:
        return engine.grid.points()
    if ks.exact is not None:
        return engine.grid.points([L])
    return engine.grid.points(engine.grid.seq_buckets())


def _every_bucket(engine, ks: Key, sample, n, L, plain: bool) -> int:
    points = _points(engine, ks, L)
    done = 0
    for i, (size, S) in enumerate(points, 1):
        with engine.lock:
            if ks.failed is not None:
                break
            if ks.exact is not None and S is not None and S != L:
                continue
            b = ks.buckets.get((size, S))
            if b is None:
                b = ks.buckets[(size, S)] = Bucket(size, S)
            go = b.serves is Serves.NOTHING
            if go:
                b.serves = Serves.CAPTURING
        # capture() takes the largest buckets first: one over the budget is left out (a larger
        # one serves its batches), never captured in place of those taken before it.
        if go and engine._capture(ks, b, sample, n, L, plain=plain, evict=False) is not None:
            done += 1
            logger.info("graphwrap: capture %d/%d of %s done", i, len(points), ks.label)
    return done


def _compile_each(engine, ks: Key, sample, n, L):
    """Replace each bucket's plain graph by one of the compiled kernels (plans are rebuilt on
    the next call; loops holding the old graphs go on replaying them)."""
    if engine.compile_opts is None or engine.compile_off is not None:
        return
    engine.background_state = "compiling"
    with engine.lock:
        cf = engine.compiled_forward()
    if cf is None:
        return
    engine.background_state = "replacing plain graphs by compiled ones"
    for point in sorted(list(ks.buckets), key=lambda p: (p[0] * (p[1] or 1)), reverse=True):
        with engine.lock:
            old = ks.buckets.get(point)
            if old is None or not old.graphs or old.compiled or ks.failed is not None:
                continue
            sample_b = [t.clone() for t in old.graphs[0].static_inputs]
        new = Bucket(old.size, old.seq)
        if engine._capture(ks, new, sample_b, old.size, old.seq, forward=cf) is not None:
            with engine.lock:
                if ks.buckets.get(point) is old:
                    swap(engine, ks, old, new)
