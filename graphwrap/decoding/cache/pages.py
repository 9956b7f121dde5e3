"""The paged layout of the cache: keys and values in blocks of positions from one pool.

Every layer keeps keys and values of shape ``[blocks, block, heads, head_dim]``. Each row has a
line of the block table (``table [rows + 1, max_len / block]``, a device tensor at a fixed
address): position ``p`` of row ``r`` lives at ``(table[r, p // block], p % block)``. A
sequence's blocks are written into its row's line when it is admitted, and each block it takes as
it grows is added to the line before the step that writes there; a row given back points
at its own scratch block again (block ``r``), where a released row, a padding row and positions
past a row's blocks write (never read unmasked). Each row has its own, so that what a step
computes for a padding row never depends on which of two rows' writes landed last (a graph's
check against eager compares every row).

A step's layer writes each row's new key at its place. Where the step's attention is
graphwrap's (:mod:`.attention`, on a CUDA device with Triton), the layer hands the pools
themselves on, and the attention reads each row's own blocks up to its length
(:mod:`.paged_attention`). Elsewhere it gathers the window's blocks of every row into ``[n,
heads, span, head_dim]`` for the model's attention: one copy of the window. Either way the
table is read on the device, inside the step's graph, so a graph replays over any assignment
of blocks. Windows span whole blocks.

On a CPU the pool grows (:meth:`PagedStore.grow`): new tensors, the old blocks copied in, the
windows made again. On a GPU it never does (the graphs hold its addresses).

A shape's graph is captured on a thread of its own while the decode thread serves (see
:mod:`.captures`), over a *twin* of the store (:meth:`PagedStore.twin`): the same pools, with
lengths, live flags, prompt rows and a table of its own. While it is captured, the twin's table
points every row at the capture blocks (blocks no sequence ever holds), so whatever the
capture's runs write and read there is the capture's own: no row's keys are touched, and its
check against eager sees no other thread's writes. Once captured, each replay of the twin's
graph has the store's own lengths, live flags and (when it changed) table copied in first, and
the lengths and live flags copied back after (:meth:`PagedStore.load`, :meth:`PagedStore.save`).
"""

import copy
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..kernels import paged_attention
from . import fp8
from .pool import blocks_for
from .rows import Store, _layers, to_device

Tensor = torch.Tensor


class PagedStore(Store):
    """A :class:`~.rows.Store` whose rows take blocks of one pool."""

    def __init__(self, rows: int, max_len: int, device: torch.device, block: int, blocks: int, kernel: bool = False):
        super().__init__(rows, max_len, device)
        self.block, self.blocks = block, blocks
        self.kernel = kernel  # steps may attend straight from the pool (paged_attention), where the model's attention is ours
        self.direct = False  # they do now (set by attention.folding around a step)
        self.layer_windows: Optional[List[Optional[int]]] = None  # each layer's sliding window, set before allocate
        self.per_row = blocks_for(max_len, block)
        # Row r's line points at its own scratch block, r, until the row takes blocks.
        self.table = self.index[:, None].repeat(1, self.per_row)
        pos = torch.arange(self.per_row * block, device=self.device)
        self.pos_block, self.pos_offset = pos // block, pos % block
        self.base = self  # the store whose metadata a twin copies (itself for the store)
        self.version = 0  # bumped at each write of the table: a twin copies it when it changed
        self.seen = -1  # (a twin's) the version its table holds
        self.twins: List["PagedStore"] = []
        self.direct_keys: List[Tensor] = []  # what a layer hands the attention for each layer: the pool, marked
        self.at = torch.zeros(3, dtype=torch.long, device=self.device)  # a piece's start, valid positions and row
        self.piece_windows: Dict[Tuple[int, int], object] = {}
        self.mixed_windows: Dict[Tuple[int, int], object] = {}
        self.scales: Optional[List[fp8.Scales]] = None  # each layer's, where the pool is FP8 (set before allocate)

    def allocate(self, layer_keys: List[Tensor], layer_values: List[Tensor]):
        """Allocate every layer's pool from one prompt cache's tensors (``[batch, heads, len, dim]``):
        of their dtype, or FP8 where the store has scales."""
        for k, v in zip(layer_keys, layer_values):
            self.keys.append(self._pool(self.blocks, k.shape[1], k.shape[3], self._dtype(k.dtype)))
            self.values.append(self._pool(self.blocks, v.shape[1], v.shape[3], self._dtype(v.dtype)))
        self._mark()

    def _dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if self.scales is None else fp8.FORMAT

    def _mark(self):
        """Each layer's pool tagged with its FP8 scales (``_gw_scales``, None in the model's dtype:
        what its layers write and read with), and, where steps read it in place, the pool as the
        attention gets it: a view marked with this store (whose table and lengths the attention
        reads), the layer's sliding window (None: full attention) and its scales."""
        scales: List[Optional[fp8.Scales]] = list(self.scales) if self.scales else [None] * len(self.keys)
        for k, v, s in zip(self.keys, self.values, scales):
            setattr(k, "_gw_scales", s)
            setattr(v, "_gw_scales", s)
        self.direct_keys = []
        if self.kernel:
            for t, window, s in zip(self.keys, self.layer_windows or [None] * len(self.keys), scales):
                view = t.view(t.shape)
                setattr(view, "_gw_pages", self)
                setattr(view, "_gw_window", window)
                setattr(view, "_gw_scales", s)
                self.direct_keys.append(view)

    def twin(self) -> "PagedStore":
        """A store over the same pools with metadata of its own, laid out for a capture: row
        ``r`` at length ``r % block`` of capture block ``first + r // block``, live, and every
        prompt into the scratch row. A forward over it writes only the capture blocks, and each
        row reads only positions written by that same forward."""
        t = copy.copy(self)
        first, rows1 = self.rows + 1, self.rows + 1
        t.lv = torch.stack([self.index % self.block, torch.ones_like(self.index)])
        t.lengths, t.live = t.lv[0], t.lv[1]
        t.slots = torch.full_like(self.slots, self.scratch)
        t.table = (first + self.index // self.block)[:, None].repeat(1, self.per_row)
        assert first + blocks_for(rows1, self.block) <= self.blocks, "the pool holds no capture blocks"
        t.windows, t.prompt_windows, t.piece_windows, t.mixed_windows, t.twins = {}, {}, {}, {}, []
        t.at = torch.zeros_like(self.at)
        t.base, t.seen = self, -1
        t._mark()
        self.twins.append(t)
        return t

    def piece_twin(self, width: int) -> "PagedStore":
        """A twin laid out for a piece's capture: row 0's line is the piece's own capture blocks
        (after the steps'), over and over, so the piece writes positions ``[0, width)`` there and
        every position it reads was written by that same forward or is masked."""
        t = self.twin()
        first = self.rows + 1 + blocks_for(self.rows + 1, self.block)
        own = blocks_for(width, self.block)
        assert first + own <= self.blocks, "the pool holds no capture blocks for a piece"
        t.table[0] = first + torch.arange(self.per_row, device=self.device) % own
        return t

    def mixed_twin(self, width: int) -> "PagedStore":
        """A twin laid out for a mixed forward's capture: the steps' rows as :meth:`twin` lays
        them out, and the piece in the scratch row (no step row reads it), whose line is the
        piece's own capture blocks, over and over."""
        t = self.twin()
        first = self.rows + 1 + blocks_for(self.rows + 1, self.block)
        own = blocks_for(width, self.block)
        assert first + own <= self.blocks, "the pool holds no capture blocks for a piece"
        t.table[self.scratch] = first + torch.arange(self.per_row, device=self.device) % own
        return t

    def load(self, twin: "PagedStore"):
        """Before a replay of ``twin``'s graph: this store's lengths and live flags, and its
        table where it changed since the last load, copied into the twin's."""
        twin.lv.copy_(self.lv)
        if twin.seen != self.version:
            twin.table.copy_(self.table)
            twin.seen = self.version

    def save(self, twin: "PagedStore"):
        """After a replay of ``twin``'s graph: what it wrote of lengths and live flags, back here."""
        self.lv.copy_(twin.lv)

    def _pool(self, blocks: int, heads: int, dim: int, dtype: torch.dtype) -> Tensor:
        return torch.zeros((blocks, self.block, heads, dim), dtype=dtype, device=self.device)

    def assign(self, rows: Sequence[int], blocks: Sequence[Sequence[int]]):
        """Write each row's line of the table: its blocks, then its scratch block."""
        host = torch.tensor(list(rows), dtype=torch.long)[:, None].repeat(1, self.per_row)
        for i, b in enumerate(blocks):
            host[i, :len(b)] = torch.tensor(list(b), dtype=torch.long)
        index = to_device(torch.tensor(list(rows), dtype=torch.long), self.device)
        self.table.index_copy_(0, index, to_device(host, self.device))
        self.version += 1

    def extend(self, rows: Sequence[int], at: Sequence[int], blocks: Sequence[int]):
        """Blocks taken by growing rows: ``table[rows[i], at[i]] = blocks[i]``, one write."""
        host = torch.tensor([list(rows), list(at), list(blocks)], dtype=torch.long)
        r, a, b = to_device(host, self.device).unbind(0)
        self.table.index_put_((r, a), b)
        self.version += 1

    def release(self, rows: Tensor):
        super().release(rows)
        self.table.index_copy_(0, rows, rows[:, None].expand(-1, self.per_row))
        self.version += 1

    def free(self):
        for s in [self] + self.twins:  # (the twins share the lists of pools)
            super(PagedStore, s).free()
            s.direct_keys = []
            s.piece_windows.clear()
            s.mixed_windows.clear()
        self.twins.clear()

    def grow(self, blocks: int):
        """The pool holds ``blocks`` blocks now (a CPU's pool; the old ones keep their place)."""
        for t in (self.keys, self.values):
            for i, old in enumerate(t):
                new = self._pool(blocks, old.shape[2], old.shape[3], old.dtype)
                new[:old.shape[0]] = old
                t[i] = new
        self.blocks = blocks
        for s in [self] + self.twins:  # (the twins share the lists of pools)
            s.blocks = blocks
            s.windows.clear()
            s.prompt_windows.clear()
            s.piece_windows.clear()
            s.mixed_windows.clear()
            s._mark()

    def step_span(self, span: int) -> int:
        """Where steps attend straight from the pool, each row reads its own length whatever the
        window: two windows serve every step, one for rows up to
        :data:`~.paged_attention.SPLIT_FROM` positions and the whole row past it (its kernel
        splits each row's positions between programs), so two graphs per row bucket."""
        if not self.kernel:
            return span
        whole = self.per_row * self.block
        short = min(whole, blocks_for(paged_attention.SPLIT_FROM, self.block) * self.block)
        return short if span <= short else whole

    def step_layers(self, span: int) -> list:
        span = min(blocks_for(span, self.block), self.per_row) * self.block
        direct: List[Optional[Tensor]] = list(self.direct_keys) or [None] * len(self.keys)
        lay = _layers()
        where = lay.StepSlots()  # each row's write slot, found by the first layer, read by the rest
        where.splits = paged_attention.splits_for(span) if self.kernel else 1
        return [lay.PagedLayer(k, v, self, span, d, where, first=i == 0)
                for i, (k, v, d) in enumerate(zip(self.keys, self.values, direct))]

    def prompt_layers(self, width: int) -> list:
        return [_layers().PagedPromptLayer(k, v, self, width) for k, v in zip(self.keys, self.values)]

    def chunk_layers(self, row: int, start: int, width: int) -> list:
        return [_layers().PagedChunkLayer(k, v, self, row, start, width) for k, v in zip(self.keys, self.values)]

    def piece_span(self, bucket: int) -> int:
        """The positions a piece attends over, for a span bucket: whole blocks, at most a row's
        (a row's, whatever the bucket, where the attention reads the pool itself: the kernel
        reads only as far as each query sees, so one graph serves every span)."""
        if self.kernel:
            return self.per_row * self.block
        return min(blocks_for(bucket, self.block), self.per_row) * self.block

    def piece_window(self, width: int, span: int):
        """What a piece of ``width`` positions of a long prompt writes through and attends over
        (its row's first ``span`` positions), the piece's place read from ``at`` (made once per
        shape, so a graph over it replays)."""
        w = self.piece_windows.get((width, span))
        if w is None:
            lay = _layers()
            windows = self.layer_windows or [None] * len(self.keys)
            w = self.piece_windows[(width, span)] = lay.PieceWindow(self, [
                lay.PagedPieceLayer(k, v, self, width, span, window) for k, v, window in zip(self.keys, self.values,
                                                                                             windows)])
        return w

    def mixed_window(self, n: int, width: int):
        """What a mixed forward of ``n`` rows' step and a piece of ``width`` positions writes
        through and attends over (made once per shape, so a graph over it replays); only where
        the attention reads the pool in place."""
        w = self.mixed_windows.get((n, width))
        if w is None:
            assert self.kernel, "a mixed forward reads the pool in place"
            lay = _layers()
            span = self.per_row * self.block
            slots = lay.StepSlots()
            slots.splits = paged_attention.splits_for(span)  # (its rows may be long: one graph serves them all)
            w = self.mixed_windows[(n, width)] = lay.MixedWindow(self, width, [
                lay.PagedMixedLayer(k, v, self, span, width, d, slots, i == 0)
                for i, (k, v, d) in enumerate(zip(self.keys, self.values, self.direct_keys))])
        return w
