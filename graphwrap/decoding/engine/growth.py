"""Blocks for the rows of a paged pool as they grow, on the decode thread.

Before each step every live row must hold the block of the position the step writes (the step's
graph reads the block table on the device). A row without it takes blocks from the pool (up to
``scheduler.GRANT`` at once), else the pool grows (a CPU's), else every token in flight is read
and the sequences found done give their blocks back, else the sequence admitted last is
preempted (:meth:`~.scheduler.Scheduler.preempt`): its row and blocks go back and it is
recomputed once admitted again. The blocks taken are written into the table in one write.
"""

import logging
from typing import List, cast

from ..cache.pages import PagedStore
from ..cache.pool import Blocks
from . import outputs
from .scheduler import Seq

logger = logging.getLogger("graphwrap")


def make_room(server, live: List[Seq]) -> List[Seq]:
    """Each live row's block for the position the step writes, oldest sequences first; the
    rows that still step (a preempted one does not)."""
    block = server.cache.block
    needy = [s for s in live if len(s.blocks) * block <= s.length]  # (Scheduler.short_of, for every row at once)
    if not needy:
        return live
    sched, pool = server.sched, cast(Blocks, server.sched.pool)
    rows: List[int] = []
    at: List[int] = []
    blocks: List[int] = []
    drained = False
    for s in sorted(needy, key=lambda s: s.order):
        while s.row is not None and not s.done and sched.short_of(s):
            got = pool.take(sched.grant(s))
            if got is not None:
                rows.extend([s.row] * len(got))
                at.extend(range(len(s.blocks), len(s.blocks) + len(got)))
                blocks.extend(got)
                s.blocks.extend(got)
            elif grow_pool(server, 1):
                continue
            elif not drained:  # every token in flight read: sequences done give their blocks back
                drained = True
                outputs.read(server, keep=0)
                outputs.retire(server)
            else:
                preempt(server, cast(Seq, sched.newest()))
    if rows:
        cast(PagedStore, server.store).extend(rows, at, blocks)
    return [s for s in live if s.row is not None and s.needs_steps]


def preempt(server, s: Seq):
    """``s`` (every token it launched read) gives back its row and blocks, to be recomputed once
    admitted again."""
    row = server.sched.preempt(s)
    outputs.release(server, [row])
    server.counts["preempted"] += 1
    logger.info("decode cache full: a sequence (%d tokens made of %d) gave back its row and blocks, to be "
                "recomputed when blocks are free (%d preemptions so far)", len(s.tokens), s.settings.max_new,
                server.counts["preempted"])


def grow_pool(server, short: int) -> bool:
    """A pool that can grow (a CPU's) takes at least ``short`` more blocks: whether it grew."""
    c, pool = server.cache, server.sched.pool
    if pool is None or pool.total >= c.most:
        return False
    total = min(c.most, max(2 * pool.total, pool.total + short))
    cast(PagedStore, server.store).grow(total)
    pool.grow(total)
    logger.info("decode cache grew to %d blocks of %d positions", total - c.scratch, c.block)
    return True
