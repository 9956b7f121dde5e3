"""The KV cache of rows: one row per sequence, each with its own length, at fixed addresses.

A :class:`Store` holds one ``lengths`` tensor ``[rows]`` shared by every layer (where each
row's next key goes) and the windows over the cache. It has two layouts (chosen by
:mod:`.pool`): :class:`RowStore` here, where every layer keeps keys and values of shape
``[rows, heads, max_len, head_dim]`` (allocated once from the first prompt's cache, so any
attention layout the model's own cache has is kept), and the paged store of :mod:`.pages`.

A decode step attends over a *window*: the first ``n`` rows and the first ``span`` positions
(``span`` a bucket above the longest live row), so a step costs what its live rows need, not
the whole cache. A window is a transformers ``Cache`` whose layers write each row's new key at
that row's own length and return the window's views; the model sees a cache of ``n`` rows and
``span`` positions and a 4-D mask (from :func:`row_mask`) that hides each row's unwritten
positions. Windows are made once per span and never change, so a graph captured over one
replays over it for good.

A prompt window (:func:`prompt_window`) is what a joined prompt forward sees: its layers write
the prompts' keys into the rows named in the store's ``slots`` (a row beyond the last, the
scratch row, takes the padding prompts of a bucket) and return the prompts' own keys.
"""

from typing import Dict, List, Optional

import torch

Tensor = torch.Tensor


class Store:
    """What both layouts of the cache share: the rows' lengths, which rows advance, the rows a
    prompt forward writes, and the windows (made once per span, so graphs over them replay)."""

    def __init__(self, rows: int, max_len: int, device: torch.device):
        self.rows, self.max_len, self.device = rows, max_len, torch.device(device)
        self.scratch = rows  # one more row: where padding prompts write
        self.keys: List[Tensor] = []
        self.values: List[Tensor] = []
        # The rows' lengths and live flags (1 for rows that advance), in one tensor: one copy
        # moves both (see PagedStore.load).
        self.lv = torch.zeros((2, rows + 1), dtype=torch.long, device=self.device)
        self.lengths, self.live = self.lv[0], self.lv[1]
        self.index = torch.arange(rows + 1, device=self.device)
        self.slots = torch.full((rows,), rows, dtype=torch.long, device=self.device)  # a prompt forward's rows
        self.windows: Dict[int, object] = {}
        self.prompt_windows: Dict[int, object] = {}

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    def free(self):
        """Let go of the cache's tensors, and of the windows over them (its batch has ended)."""
        self.keys.clear()
        self.values.clear()
        self.windows.clear()
        self.prompt_windows.clear()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def release(self, rows: Tensor):
        """Rows that no longer advance: length 0 (their writes land at position 0 of a free row)."""
        self.lengths.index_fill_(0, rows, 0)
        self.live.index_fill_(0, rows, 0)

    def window(self, span: int):
        """The cache the model sees in a step over ``span`` positions (made once per span)."""
        w = self.windows.get(span)
        if w is None:
            w = self.windows[span] = _layers().RowWindow(self, span, self.step_layers(span))
        return w

    def prompt_window(self, width: int):
        """The cache a joined prompt forward of ``width`` positions sees (made once per width)."""
        w = self.prompt_windows.get(width)
        if w is None:
            w = self.prompt_windows[width] = _layers().PromptWindow(self, width, self.prompt_layers(width))
        return w

    def whole_window(self, width: int):
        """The cache a long prompt's forward of ``width`` positions, alone, sees: the prompt
        window's layers, made for that forward (its width is the prompt's own)."""
        return _layers().PromptWindow(self, width, self.prompt_layers(width))

    def chunk_window(self, row: int, start: int, width: int):
        """The cache one piece of a long prompt sees: it writes positions ``[start, start +
        width)`` of ``row`` and attends over ``[0, start + width)`` of it (made per piece, for
        an eager forward)."""
        return _layers().ChunkWindow(start, self.chunk_layers(row, start, width))

    def step_span(self, span: int) -> int:
        """The window a step over ``span`` live positions uses."""
        return span

    def step_layers(self, span: int) -> list:
        raise NotImplementedError

    def prompt_layers(self, width: int) -> list:
        raise NotImplementedError

    def chunk_layers(self, row: int, start: int, width: int) -> list:
        raise NotImplementedError


class RowStore(Store):
    """Every row whole at a fixed place: per layer, keys and values ``[rows + 1, heads, max_len, dim]``."""

    def allocate(self, layer_keys: List[Tensor], layer_values: List[Tensor]):
        """Allocate every layer from one prompt cache's tensors (``[batch, heads, len, dim]``)."""
        for k, v in zip(layer_keys, layer_values):
            self.keys.append(torch.zeros((self.rows + 1, k.shape[1], self.max_len, k.shape[3]), dtype=k.dtype,
                                         device=self.device))
            self.values.append(torch.zeros((self.rows + 1, v.shape[1], self.max_len, v.shape[3]), dtype=v.dtype,
                                           device=self.device))

    def step_layers(self, span: int) -> list:
        return [_layers().RowLayer(k, v, self.lengths, self.index, span) for k, v in zip(self.keys, self.values)]

    def prompt_layers(self, width: int) -> list:
        return [_layers().PromptLayer(k, v, self.lengths, self.index, width, self.slots) for k, v in zip(self.keys, self.values)]

    def chunk_layers(self, row: int, start: int, width: int) -> list:
        return [_layers().ChunkLayer(k, v, row, start, width) for k, v in zip(self.keys, self.values)]


def _layers():
    from . import layers  # (transformers, imported where a window is made)

    return layers


def to_device(t: Tensor, device) -> Tensor:
    """A host tensor on ``device`` without waiting for the device (through pinned memory; a
    pageable copy would wait for every step queued)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def row_mask(lengths: Tensor, span: int, dtype: torch.dtype, window: Optional[int] = None) -> Tensor:
    """The additive 4-D mask ``[n, 1, 1, span]`` of a step: position ``j`` of row ``b`` is seen
    where ``j <= lengths[b]`` (its written keys and the one this step writes) and, with a
    sliding window, ``j > lengths[b] - window``."""
    pos = torch.arange(span, device=lengths.device)
    seen = pos[None, :] <= lengths[:, None]
    if window:
        seen = seen & (pos[None, :] > lengths[:, None] - window)
    zero = torch.zeros((), dtype=dtype, device=lengths.device)
    return torch.where(seen, zero, torch.finfo(dtype).min)[:, None, None, :]
