"""What ``stats()["decode"]`` says of a shared batch."""

import collections
import heapq
from typing import List, Tuple

from ..cache import fp8
from . import collector, pieces, schedule

SLOWEST = 5  # turns kept whole, with their parts


def report(server) -> dict:
    c = server.counts
    with server.lock:
        queued, busy = len(server.sched.queue), server.sched.busy
        pool = server.sched.pool
        blocks = {"block": server.cache.block, "used": pool.used, "free": pool.available} if pool else None
        prefixes = pool.prefixes if pool else None
        cached = None if prefixes is None else {"prefix_cache_queries": prefixes.queries,
                                                "prefix_cache_hits": prefixes.hits, "blocks": prefixes.cached}
    return {
        "rows": server.rows, "max_len": server.max_len, "device": str(server.device), "cache_bytes": server.store.nbytes(),
        "cache": "paged" if server.cache.paged else "rows", "cache_budget_bytes": server.cache.budget,
        "cache_blocks": blocks, "prefix_cache": cached, "kv_cache": fp8.describe(getattr(server.store, "scales", None)),
        "calls": c["calls"], "sequences": c["sequences"], "done": c["done"], "failed": c["failed"],
        "cancelled": c["cancelled"], "queued": queued, "rows_busy": busy, "preempted": c["preempted"],
        "steps": c["steps"], "rows_per_step": c["step_rows"] / c["steps"] if c["steps"] else 0.0,
        "padded_rows_per_step": c["step_padded_rows"] / c["steps"] if c["steps"] else 0.0,
        **server.shapes.counts(),
        "captures": None if server.captures is None else {
            "queued": server.captures.queued(), "done": server.captures.done,
            "seconds": round(server.captures.seconds, 3), "compiled": sorted(server.compiled)},
        "prefills": c["prefills"], "rows_per_prefill": c["prefill_rows"] / c["prefills"] if c["prefills"] else 0.0,
        "prefill_pieces": c["prefill_pieces"], "piece_turns_skipped": c["piece_turns_skipped"],
        "prefill_budget": pieces.budget_of(server), "budget_pieces": c["budget_pieces"],
        "prefill_whole": pieces.whole_of(server), "whole_prefills": c["whole_prefills"],
        "prefill_beside": schedule.beside_of(server),
        "whole_no_memory": c["whole_no_memory"],
        "mixed_steps": c["mixed_steps"], "mixed_failed": c["mixed_failed"],  # (a piece inside a step: steps.py)
        "mixed": server.mixed_engine.stats() if server.mixed_engine is not None else None,
        "sampler_graphs": _sampler(server.settings.graphs),  # (a step's sampling replayed: sampler_graphs.py)
        "queue_wait_ms": percentiles(server.waits), "ttft_ms": percentiles(server.ttft),
        "tpot_ms": percentiles(server.tpot), "turn_ms": dict(percentiles(server.turns.seconds), max=_max_ms(server.turns.seconds)),
        "slowest_turns": server.turns.slowest(),
        "collector_pauses": collector.clock().report(),  # (the process's, since its first batch)
        "delivery_lag_ms": dict(percentiles(server.lag), max=_max_ms(server.lag)),
        "thread_s": {k: round(v, 3) for k, v in server.spent.items()},
    }


def _sampler(graphs) -> "dict | None":
    """The sampler's graphs (None where the batch samples eagerly: a CPU): how many, the steps
    they served, the steps sampled eagerly (a key's first sighting, a capture under way elsewhere,
    past the most graphs), and captures that failed."""
    return None if graphs is None else dict(graphs.counts, graphs=len(graphs.entries))


def percentiles(xs) -> dict:
    if not xs:
        return {"p50": None, "p99": None}
    xs = sorted(xs)
    return {"p50": 1e3 * xs[len(xs) // 2], "p99": 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))]}


def _max_ms(xs) -> "float | None":
    return 1e3 * max(xs) if xs else None


class Turns:
    """The decode thread's working turns: the last ``keep`` durations, and the slowest few since
    the batch was made with what they did (admit and prefill, step, read, retire; sequences
    admitted, rows live). Appended by the decode thread, read by any."""

    def __init__(self, keep: int):
        self.seconds: "collections.deque[float]" = collections.deque(maxlen=keep)
        self.top: List[Tuple[float, Tuple[float, ...], int, int]] = []  # a min-heap of the slowest

    def add(self, seconds: float, parts: Tuple[float, ...], admitted: int, live: int):
        self.seconds.append(seconds)
        if len(self.top) < SLOWEST:
            heapq.heappush(self.top, (seconds, parts, admitted, live))
        elif seconds > self.top[0][0]:
            heapq.heapreplace(self.top, (seconds, parts, admitted, live))

    def slowest(self) -> List[dict]:
        return [{"ms": round(1e3 * t, 2), "admit_prefill_ms": round(1e3 * p[0], 2), "step_ms": round(1e3 * p[1], 2),
                 "read_ms": round(1e3 * p[2], 2), "retire_ms": round(1e3 * p[3], 2), "admitted": a, "live": n}
                for t, p, a, n in sorted(list(self.top), reverse=True)]
