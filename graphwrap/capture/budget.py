"""The memory budget (``max_pool_bytes``): what the graphs of a pool hold, and room made for a
new graph by dropping the graphs of the least used buckets (captured again when needed)."""

import logging
from typing import Optional

import torch

from ..core.plans import fold
from ..core.records import Bucket, Serves

logger = logging.getLogger("graphwrap")


def budget_left(engine) -> Optional[int]:
    budget = engine.opts.max_pool_bytes
    if budget is None:
        return None
    return budget - _held_total(engine)


def _held_total(engine) -> int:
    return sum(_held(b) for ks in engine.store.keys.values() for b in ks.buckets.values())


def _held(b: Bucket) -> int:
    """What a bucket's graphs added to the pool (its growth when they were captured)."""
    return b.pool_bytes if b.graphs else 0


def large_budget(device, budget: Optional[int]) -> int:
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
    left = budget - _held_total(engine)
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
        engine.store.dropped.extend(b.graphs)
        b.graphs = []
        b.serves = Serves.NOTHING
        logger.info("bucket %s of %s dropped for max_pool_bytes (least used); captured again when needed",
                    b.name, ks.label)
    return True


def release_dropped(engine, device):
    """Free evicted graphs once the device is done with their last replays."""
    with engine.lock:
        dropped, engine.store.dropped = engine.store.dropped, []
    if dropped:
        engine.backend.sync(device)
        del dropped
