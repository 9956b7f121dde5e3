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
"""

from typing import List, Optional, Sequence

import torch

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

    def allocate(self, layer_keys: List[Tensor], layer_values: List[Tensor]):
        """Allocate every layer's pool from one prompt cache's tensors (``[batch, heads, len, dim]``)."""
        for k, v in zip(layer_keys, layer_values):
            self.keys.append(self._pool(self.blocks, k.shape[1], k.shape[3], k.dtype))
            self.values.append(self._pool(self.blocks, v.shape[1], v.shape[3], v.dtype))
        if self.kernel:
            for t, window in zip(self.keys, self.layer_windows or [None] * len(self.keys)):
                setattr(t, "_gw_pages", self)  # what the attention function reads the table and lengths from
                setattr(t, "_gw_window", window)  # and the layer's sliding window (None: full attention)

    def _pool(self, blocks: int, heads: int, dim: int, dtype: torch.dtype) -> Tensor:
        return torch.zeros((blocks, self.block, heads, dim), dtype=dtype, device=self.device)

    def assign(self, rows: Sequence[int], blocks: Sequence[Sequence[int]]):
        """Write each row's line of the table: its blocks, then its scratch block."""
        host = torch.tensor(list(rows), dtype=torch.long)[:, None].repeat(1, self.per_row)
        for i, b in enumerate(blocks):
            host[i, :len(b)] = torch.tensor(list(b), dtype=torch.long)
        index = to_device(torch.tensor(list(rows), dtype=torch.long), self.device)
        self.table.index_copy_(0, index, to_device(host, self.device))

    def extend(self, rows: Sequence[int], at: Sequence[int], blocks: Sequence[int]):
        """Blocks taken by growing rows: ``table[rows[i], at[i]] = blocks[i]``, one write."""
        host = torch.tensor([list(rows), list(at), list(blocks)], dtype=torch.long)
        r, a, b = to_device(host, self.device).unbind(0)
        self.table.index_put_((r, a), b)

    def release(self, rows: Tensor):
        super().release(rows)
        self.table.index_copy_(0, rows, rows[:, None].expand(-1, self.per_row))

    def grow(self, blocks: int):
        """The pool holds ``blocks`` blocks now (a CPU's pool; the old ones keep their place)."""
        for t in (self.keys, self.values):
            for i, old in enumerate(t):
                new = self._pool(blocks, old.shape[2], old.shape[3], old.dtype)
                new[:old.shape[0]] = old
                t[i] = new
        self.blocks = blocks
        self.windows.clear()
        self.prompt_windows.clear()

    def step_span(self, span: int) -> int:
        """Where steps attend straight from the pool, one window for every step (each row reads
        its own length whatever the window): one graph per row bucket."""
        return self.per_row * self.block if self.kernel else span

    def step_layers(self, span: int) -> list:
        span = min(blocks_for(span, self.block), self.per_row) * self.block
        return [_layers().PagedLayer(k, v, self, span) for k, v in zip(self.keys, self.values)]

    def prompt_layers(self, width: int) -> list:
        return [_layers().PagedPromptLayer(k, v, self, width) for k, v in zip(self.keys, self.values)]

    def chunk_layers(self, row: int, start: int, width: int) -> list:
        return [_layers().PagedChunkLayer(k, v, self, row, start, width) for k, v in zip(self.keys, self.values)]
