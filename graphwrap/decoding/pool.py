"""How much memory the shared batch's cache takes, how it is laid out, and its blocks.

Plain Python, no tensors. :func:`plan_cache` decides once, when the batch is made, between two
layouts of the same cache (see :mod:`.rows` and :mod:`.pages`):

- **rows**: every row holds the model's whole context at a fixed place (``rows x max_len``
  positions). Used where that fits the budget: a step then attends over views of the cache,
  with no copy (the smaller models).
- **paged**: keys and values in blocks of ``BLOCK`` positions from one pool; a sequence takes
  the blocks its prompt and ``max_new_tokens`` need when it is admitted and gives them back
  when it ends, so memory follows the requests, not rows x the longest length. A step gathers
  each row's blocks of its window before attention (one copy of the window's keys and values).

The budget, on a GPU, is a fraction (``cache_memory``, default :data:`CACHE_MEMORY`) of the
memory free when the batch is made (after the weights); the rest is the graphs' and the
forwards' working memory. On a CPU the pool starts small and grows on demand up to the whole
context of every row.
"""

from dataclasses import dataclass
from typing import List, Optional

BLOCK = 16  # positions per block of the paged pool
CACHE_MEMORY = 0.7  # default share of the GPU memory free at the batch's making that the cache may take
CPU_START = 256  # positions per row the CPU pool holds at first (it doubles when a sequence needs more)


@dataclass(frozen=True)
class CachePlan:
    """The cache's layout and size."""

    paged: bool
    block: int  # positions per block (max_len where not paged)
    blocks: int  # blocks of the pool at first, the scratch block included (0 where not paged)
    most: int  # blocks the pool may grow to (== blocks where it cannot grow)
    token_bytes: int  # bytes of keys and values of one position over every layer
    budget: Optional[int]  # bytes the cache may take (None: no device limit known)
    why: str  # how it was decided, for the log

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block * self.token_bytes

    @property
    def positions(self) -> int:
        """Positions sequences may hold at once, at most (over every row)."""
        return (self.most - 1) * self.block if self.paged else 0


def plan_cache(rows: int, max_len: int, token_bytes: int, free: Optional[int], fraction: float = CACHE_MEMORY,
               paged: Optional[bool] = None) -> CachePlan:
    """The cache of ``rows`` sequences of up to ``max_len`` positions, ``token_bytes`` a position,
    with ``free`` bytes of device memory free (None on a CPU). ``paged`` forces a layout."""
    whole = (rows + 1) * max_len * token_bytes  # the rows layout: every row (and the scratch row) whole
    per_row = -(-max_len // BLOCK)
    most = rows * per_row + 1  # paged, every row whole (one scratch block more)
    if free is None:  # a CPU: no budget to keep to
        if paged is False:
            return CachePlan(False, max_len, 0, 0, token_bytes, None, "rows (asked for)")
        start = min(most, rows * -(-min(CPU_START, max_len) // BLOCK) + 1)
        return CachePlan(True, BLOCK, start, most, token_bytes, None,
                         f"paged, growing on demand from {start - 1} blocks of {BLOCK} positions")
    budget = int(fraction * free)
    if paged is None:
        paged = whole > budget
    if not paged:
        return CachePlan(False, max_len, 0, 0, token_bytes, budget,
                         f"rows: {rows} x {max_len} positions fit {fraction:.0%} of the free memory")
    blocks = min(most, budget // (BLOCK * token_bytes))
    if blocks < 2:
        raise MemoryError(f"{fraction:.0%} of the free memory ({budget} bytes) holds no block of {BLOCK} positions "
                          f"({BLOCK * token_bytes} bytes)")
    return CachePlan(True, BLOCK, blocks, blocks, token_bytes, budget,
                     f"paged: {blocks - 1} blocks of {BLOCK} positions ({(blocks - 1) * BLOCK} positions in all), "
                     f"{fraction:.0%} of the free memory")


class Blocks:
    """The pool's free blocks. Block 0 is the scratch block (where released rows and padding
    write), never handed out."""

    def __init__(self, total: int):
        self.total = total
        self.free: List[int] = list(range(total - 1, 0, -1))  # popped from the end: lowest first

    def take(self, n: int) -> Optional[List[int]]:
        """``n`` blocks, or None (nothing taken) where fewer are free."""
        if n > len(self.free):
            return None
        out = self.free[-n:][::-1] if n else []
        del self.free[len(self.free) - n:]
        return out

    def give(self, blocks: List[int]):
        self.free.extend(blocks)

    def grow(self, total: int):
        """The pool now has ``total`` blocks: the new ones are free."""
        self.free[:0] = list(range(total - 1, self.total - 1, -1))
        self.total = total

    @property
    def used(self) -> int:
        return self.total - 1 - len(self.free)


def blocks_for(positions: int, block: int) -> int:
    return -(-positions // block)
