"""Timing a bucket's graph against eager on the same inputs, as calls make them, so a bucket
whose eager calls are faster is served eagerly (``eager_if_faster``)."""

import contextlib
import logging
import time
from typing import Callable, List, Optional, Sequence

import torch

from .._compat import autocast_without_cache
from ..core.plans import Plan, fold
from ..core.records import Bucket, Key, Serves
from ..core.tree import unflatten_inputs

logger = logging.getLogger("graphwrap")
# A bucket serves its calls eagerly when eager took at most this share of the graph's time.
EAGER_WINS = 0.9  # near a tie, graphs: they also leave the host free, which counts under load


def time_turns(rounds_of: Sequence[Callable[[int], float]], rounds: int, round_s: float, keep=min,
               enough: Optional[Callable[[List[float]], bool]] = None) -> List[float]:
    """Seconds per call of each of ``rounds_of`` (``fn(k)`` makes ``k`` calls and returns the
    seconds a call took), timed in turns round by round, ``k`` such that a round lasts about
    ``round_s``. ``keep`` makes one figure of each one's rounds (``min``: the best round, as other
    work on the host or device only ever slows one; ``statistics.median``); ``enough(figures)``
    ends the rounds early."""
    once = max(fn(1) for fn in rounds_of)
    k = max(1, min(64, int(round_s / max(once, 1e-6))))
    times: List[List[float]] = [[] for _ in rounds_of]
    for _ in range(rounds):
        for fn, ts in zip(rounds_of, times):
            ts.append(fn(k))
        if enough is not None and enough([keep(ts) for ts in times]):
            break
    return [keep(ts) for ts in times]


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
        held = None
        if plan.ring is not None:  # the same call when the caller holds every slot: replay and clone
            held = Plan(engine, ks, b.size, b.seq, b)
            held.ring = None
        leaves = [t.clone() for t in b.graphs[0].static_inputs]
    device = ks.device
    sync = engine.backend.sync
    args, kwargs = unflatten_inputs(ks.spec, leaves)

    def graph_round(k, plan=plan):
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

    timed = [graph_round, eager_round] + ([lambda k: graph_round(k, held)] if held is not None else [])
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            # No more rounds once the graph is twice as fast: eager cannot win.
            got = time_turns(timed, rounds, round_s, enough=lambda s: 2 * s[-1 if held is not None else 0] <= s[1])
    except _Dropped:
        return
    _settle(engine, ks, b, got[0], got[1], got[2] if held is not None else None)


def _settle(engine, ks: Key, b: Bucket, graph_s: float, eager_s: float, held_s: Optional[float]):
    """What serves the bucket after the race, and its times kept for ``stats()``."""
    with engine.lock:
        b.graph_us, b.eager_us = 1e6 * graph_s, 1e6 * eager_s
        if held_s is not None:
            b.held_us = 1e6 * held_s
            if eager_s <= EAGER_WINS * held_s and not b.eager_when_held:
                b.eager_when_held = True
                fold(engine, ks, b)  # plans made from here on run eagerly when every slot is held
                logger.info("bucket %s of %s: calls whose outputs the caller still holds run eagerly "
                            "(%.1f us a call, a replay and a clone %.1f us)", b.name, ks.label, b.eager_us,
                            b.held_us)
        if eager_s <= EAGER_WINS * graph_s and b.serves is Serves.GRAPH:
            b.serves = Serves.EAGER
            fold(engine, ks, b)
            logger.info("bucket %s of %s runs eagerly: eager took %.1f us a call, the graph %.1f us",
                        b.name, ks.label, b.eager_us, b.graph_us)
