"""How much memory the shared batch's cache takes, how it is laid out, and its blocks.

Plain Python, no tensors. :func:`plan_cache` decides once, when the batch is made, between two
layouts of the same cache (see :mod:`.rows` and :mod:`.pages`):

- **paged**: keys and values in blocks of ``BLOCK`` positions from one pool; a sequence takes
  the blocks its prompt needs when it is admitted, one more each time it grows past its last,
  and gives them back when it ends, so memory follows the tokens in use, not rows x the longest
  length (nor each request's ``max_new_tokens``). On a CUDA
  device with Triton a step reads each row's blocks in place, up to its own length (the
  default there); elsewhere it gathers each row's blocks of its window before attention (one
  copy of the window's keys and values).
- **rows**: every row holds the model's whole context at a fixed place (``rows x max_len``
  positions); a step attends over views of the rows, padded to the longest live row. Used
  where the pool cannot be read in place and every row whole fits the budget.

The budget, on a GPU, is a fraction (``cache_memory``, default :data:`CACHE_MEMORY`) of the
memory free when the batch is made (after the weights); the rest is the graphs' and the
forwards' working memory. On a CPU the pool starts with a few blocks and doubles on demand up to
the whole context of every row, so that its memory follows the rows in use.
"""

import collections
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, cast

BLOCK = 16  # positions per block of the paged pool
CACHE_MEMORY = 0.7  # default share of the GPU memory free at the batch's making that the cache may take
CPU_START = 512  # positions the CPU pool holds at first beside its scratch blocks (it doubles when sequences need more)
PIECE = 128  # positions of a long prompt's piece in the paged pool beside decoding rows (a replay a turn, pieces.py)
PIECE_ALONE = 512  # ... with no row decoding beside it (its weights read a quarter as often)
MAX_ROWS = 1024  # rows a step may hold by default, at most (where the pool holds ROW_POSITIONS for each)
MIN_ROWS = 64  # ... at least (and a CPU's, whose pool follows the rows in use)
ROW_POSITIONS = 512  # positions per row, on average, that the default row count leaves each in the pool


@dataclass(frozen=True)
class CachePlan:
    """The cache's layout and size."""

    paged: bool
    block: int  # positions per block (max_len where not paged)
    blocks: int  # blocks of the pool at first, the scratch blocks included (0 where not paged)
    most: int  # blocks the pool may grow to (== blocks where it cannot grow)
    scratch: int  # blocks 0 .. scratch - 1: one per row (and one for padding prompts), then the captures', never handed out
    token_bytes: int  # bytes of keys and values of one position over every layer
    budget: Optional[int]  # bytes the cache may take (None: no device limit known)
    why: str  # how it was decided, for the log

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block * self.token_bytes

    @property
    def positions(self) -> int:
        """Positions sequences may hold at once, at most (over every row)."""
        return (self.most - self.scratch) * self.block if self.paged else 0


def plan_cache(rows: int, max_len: int, token_bytes: int, free: Optional[int], fraction: float = CACHE_MEMORY,
               paged: Optional[bool] = None, in_place: bool = False) -> CachePlan:
    """The cache of ``rows`` sequences of up to ``max_len`` positions, ``token_bytes`` a position,
    with ``free`` bytes of device memory free (None on a CPU). ``paged`` forces a layout;
    ``in_place``: steps can read the pool in place (the paged attention kernel runs), which
    makes the paged layout the default."""
    whole = (rows + 1) * max_len * token_bytes  # the rows layout: every row (and the scratch row) whole
    per_row = -(-max_len // BLOCK)
    scratch = scratch_blocks(rows, BLOCK)
    most = rows * per_row + scratch  # paged, every row whole
    if free is None:  # a CPU: no budget to keep to
        if paged is False:
            return CachePlan(False, max_len, 0, 0, 0, token_bytes, None, "rows (asked for)")
        start = min(most, blocks_for(CPU_START, BLOCK) + scratch)  # memory follows the rows in use
        return CachePlan(True, BLOCK, start, most, scratch, token_bytes, None,
                         f"paged, growing on demand from {start - scratch} blocks of {BLOCK} positions")
    budget = int(fraction * free)
    if paged is None:
        paged = in_place or whole > budget
    if not paged:
        return CachePlan(False, max_len, 0, 0, 0, token_bytes, budget,
                         f"rows: {rows} x {max_len} positions fit {fraction:.0%} of the free memory")
    blocks = min(most, budget // (BLOCK * token_bytes))
    if blocks <= scratch:
        raise MemoryError(f"{fraction:.0%} of the free memory ({budget} bytes) holds no block of {BLOCK} positions "
                          f"({BLOCK * token_bytes} bytes) beside the rows' {scratch} scratch blocks")
    return CachePlan(True, BLOCK, blocks, blocks, scratch, token_bytes, budget,
                     f"paged: {blocks - scratch} blocks of {BLOCK} positions ({(blocks - scratch) * BLOCK} positions "
                     f"in all), {fraction:.0%} of the free memory")


class Blocks:
    """The pool's free blocks. Blocks ``0 .. scratch - 1`` are the rows' scratch blocks (where a
    released or padding row writes, each its own, so that what one writes never depends on
    another), never handed out. With ``prefixes`` (a :class:`Prefixes`), full blocks known by
    their content stay cached when their sequences give them back, and are taken again, least
    recently used first, when no block is free."""

    def __init__(self, total: int, scratch: int = 1, prefixes: Optional["Prefixes"] = None):
        self.total, self.scratch = total, scratch
        self.free: List[int] = list(range(total - 1, scratch - 1, -1))  # popped from the end: lowest first
        self.prefixes = prefixes

    @property
    def available(self) -> int:
        """Blocks a sequence may take: the free ones and the cached ones no sequence holds."""
        return len(self.free) + (len(self.prefixes.idle) if self.prefixes is not None else 0)

    def take(self, n: int) -> Optional[List[int]]:
        """``n`` blocks, or None (nothing taken) where fewer are available."""
        if n > self.available:
            return None
        while len(self.free) < n:
            self.free.extend(cast(Prefixes, self.prefixes).evict())
        out = self.free[-n:][::-1] if n else []
        del self.free[len(self.free) - n:]
        return out

    def give(self, blocks: List[int]):
        self.free.extend(blocks if self.prefixes is None else self.prefixes.release(blocks))

    def grow(self, total: int):
        """The pool now has ``total`` blocks: the new ones are free."""
        self.free[:0] = list(range(total - 1, self.total - 1, -1))
        self.total = total

    @property
    def used(self) -> int:
        """Blocks sequences hold."""
        return self.total - self.scratch - self.available


def chain_hashes(tokens: Sequence[int], block: int, n: int) -> List[int]:
    """Chained hashes of ``tokens``' first ``n`` full blocks: block ``i``'s covers every token up to
    its end (for what waits on a block being written and for routing: a collision costs a wait
    or a routing choice, never an answer, which :class:`Prefixes`' exact keys decide)."""
    out: List[int] = []
    h = 0
    for i in range(min(n, len(tokens) // block)):
        h = hash((h, tuple(tokens[i * block:(i + 1) * block])))
        out.append(h)
    return out


class Prefixes:
    """Full blocks of the pool known by their content (plain Python, no tensors): a block's key
    is the block before it (-1 for a sequence's first) and its ``block`` tokens, so a key names
    its whole prefix exactly (no hash to collide). A block is cached once the forward that writes
    it is queued, held by each sequence that took it (``refs``), and kept when the last gives it
    back (``idle``, least recently used first) until the pool needs it; a block taken for other
    content drops its key, and with it the keys of the cached blocks that follow it. Cached
    blocks are full and a sequence writes only past them, so none is written while shared."""

    def __init__(self, block: int):
        self.block = block
        self.by_key: Dict[Tuple[int, Tuple[int, ...]], int] = {}
        self.key_of: Dict[int, Tuple[int, Tuple[int, ...]]] = {}
        self.after: Dict[int, List[int]] = {}  # block -> cached blocks keyed after it
        self.refs: Dict[int, int] = {}  # cached block -> sequences holding it
        self.idle: "collections.OrderedDict[int, None]" = collections.OrderedDict()
        self.queries = self.hits = 0  # prompt tokens admitted (looked up or not: Scheduler.cacheable), and found

    def match(self, tokens: Sequence[int], most: int) -> List[int]:
        """The cached blocks that hold ``tokens``' first full blocks, at most ``most`` of them."""
        chain: List[int] = []
        parent, b = -1, self.block
        for i in range(most):
            got = self.by_key.get((parent, tuple(tokens[i * b:(i + 1) * b])))
            if got is None:
                break
            chain.append(got)
            parent = got
        return chain

    def share(self, chain: List[int]):
        """A sequence takes ``chain`` (cached blocks, from :meth:`match`)."""
        for b in chain:
            self.refs[b] = self.refs.get(b, 0) + 1
            self.idle.pop(b, None)

    def register(self, blocks: Sequence[int], tokens: Sequence[int]):
        """``blocks`` (a sequence's, in order) now hold ``tokens`` (its forward is queued): its
        full blocks become known by their content, up to the first whose content another block
        holds already (that one and those after it stay the sequence's own: a cached block's
        prefix is always held with it)."""
        parent, b = -1, self.block
        for i in range(min(len(tokens) // b, len(blocks))):
            key = (parent, tuple(tokens[i * b:(i + 1) * b]))
            got, block = self.by_key.get(key), blocks[i]
            if got is None and block not in self.key_of:
                self.by_key[key], self.key_of[block] = block, key
                self.refs[block] = self.refs.get(block, 0) + 1
                self.after.setdefault(parent, []).append(block)
            elif got != block:
                return
            parent = block

    def release(self, blocks: List[int]) -> List[int]:
        """A sequence gives ``blocks`` back: the cached ones it held last go idle (its last
        block first, so that a prefix outlives what follows it); the others, returned, are free."""
        free = []
        for b in reversed(blocks):
            if b not in self.key_of:
                free.append(b)
                continue
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                self.idle[b] = None
        return free

    def evict(self) -> List[int]:
        """The least recently used idle block, its key dropped with those keyed after it (all
        idle: a sequence holding one holds its prefix); every block so freed."""
        out = [self.idle.popitem(last=False)[0]]
        for b in out:  # (grows as it goes)
            parent = b
            self.by_key.pop(self.key_of.pop(b))
            for child in self.after.pop(parent, []):
                if self.key_of.get(child, (None,))[0] == parent:
                    assert child not in self.refs, "a cached block held while its prefix went"
                    self.idle.pop(child, None)
                    out.append(child)
        return out

    def clear(self) -> List[int]:
        """Forget every block's content (the model's values changed): the idle blocks, returned,
        are free again; those held stay their holders' and are given back free."""
        idle = list(self.idle)
        for d in (self.by_key, self.key_of, self.after, self.refs, self.idle):
            d.clear()
        return idle

    @property
    def cached(self) -> int:
        return len(self.key_of)


def rows_for(token_bytes: int, free: Optional[int], fraction: float = CACHE_MEMORY) -> int:
    """How many rows a step may hold where ``decode={"rows": ...}`` is not given: as many as the
    pool (``fraction`` of ``free`` bytes, ``token_bytes`` a position) holds :data:`ROW_POSITIONS`
    positions for, in steps of 64, between :data:`MIN_ROWS` and :data:`MAX_ROWS`; on a CPU
    (``free`` None) :data:`MIN_ROWS`. Rows beyond those in use cost a scratch block each and
    nothing else: a step's graph covers the live rows' bucket, and the pool is shared."""
    if free is None:
        return MIN_ROWS
    rows = int(fraction * free) // max(token_bytes, 1) // ROW_POSITIONS
    return max(MIN_ROWS, min(MAX_ROWS, rows // 64 * 64))


def rows_possible(paged: Optional[bool], on_gpu: bool, in_place: bool) -> bool:
    """Whether :func:`plan_cache` may choose the rows layout (``paged`` as given, the device a
    GPU, steps able to read the pool in place)."""
    if paged is not None:
        return not paged
    return on_gpu and not in_place


def scratch_blocks(rows: int, block: int) -> int:
    """Blocks never handed out: one per row and one for padding prompts (blocks ``0 .. rows``),
    then the blocks the shapes' captures write and read (:meth:`.pages.PagedStore.twin`): one
    position for each of those ``rows + 1``, then the widest piece's positions
    (:meth:`.pages.PagedStore.piece_twin`)."""
    return rows + 1 + blocks_for(rows + 1, block) + blocks_for(max(PIECE, PIECE_ALONE), block)


def blocks_for(positions: int, block: int) -> int:
    return -(-positions // block)
