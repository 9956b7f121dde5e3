"""The KV cache of rows: one row per sequence, each with its own length, at fixed addresses.

Every layer keeps keys and values of shape ``[rows, heads, max_len, head_dim]``, allocated once
from the first prompt's cache (so any attention layout the model's own cache has is kept), and
one ``lengths`` tensor ``[rows]`` shared by every layer says where each row's next key goes.

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


class RowStore:
    """The cache's tensors: per layer, keys and values of every row, and the rows' lengths."""

    def __init__(self, rows: int, max_len: int, device: torch.device):
        self.rows, self.max_len, self.device = rows, max_len, torch.device(device)
        self.scratch = rows  # one more row: where padding prompts write
        self.keys: List[Tensor] = []
        self.values: List[Tensor] = []
        self.lengths = torch.zeros(rows + 1, dtype=torch.long, device=self.device)
        self.live = torch.zeros(rows + 1, dtype=torch.long, device=self.device)  # 1 for rows that advance
        self.index = torch.arange(rows + 1, device=self.device)
        self.slots = torch.full((rows,), rows, dtype=torch.long, device=self.device)  # a prompt forward's rows
        self.windows: Dict[int, object] = {}
        self.prompt_windows: Dict[int, object] = {}

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    def allocate(self, layer_keys: List[Tensor], layer_values: List[Tensor]):
        """Allocate every layer from one prompt cache's tensors (``[batch, heads, len, dim]``)."""
        for k, v in zip(layer_keys, layer_values):
            self.keys.append(torch.zeros((self.rows + 1, k.shape[1], self.max_len, k.shape[3]), dtype=k.dtype,
                                         device=self.device))
            self.values.append(torch.zeros((self.rows + 1, v.shape[1], self.max_len, v.shape[3]), dtype=v.dtype,
                                           device=self.device))

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
            w = self.windows[span] = _classes()[0](self, span)
        return w

    def prompt_window(self, width: int):
        """The cache a joined prompt forward of ``width`` positions sees (made once per width)."""
        w = self.prompt_windows.get(width)
        if w is None:
            w = self.prompt_windows[width] = _classes()[1](self, width)
        return w


def to_device(t: Tensor, device) -> Tensor:
    """A host tensor on ``device`` without waiting for the device (through pinned memory; a
    pageable copy would wait for every step queued)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def row_mask(lengths: Tensor, span: int, dtype: torch.dtype) -> Tensor:
    """The additive 4-D mask ``[n, 1, 1, span]`` of a step: position ``j`` of row ``b`` is seen
    where ``j <= lengths[b]`` (its written keys and the one this step writes)."""
    pos = torch.arange(span, device=lengths.device)
    seen = pos[None, :] <= lengths[:, None]
    zero = torch.zeros((), dtype=dtype, device=lengths.device)
    return torch.where(seen, zero, torch.finfo(dtype).min)[:, None, None, :]


_CLASSES: Optional[tuple] = None


def _classes() -> tuple:
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _build_classes()
    return _CLASSES


def _build_classes():
    from transformers.cache_utils import Cache

    RowLayer, PromptLayer = _layer_classes()

    class RowWindow(Cache):
        """The first ``span`` positions of every row of a :class:`RowStore`, as a ``Cache``."""

        def __init__(self, store: RowStore, span: int):
            layers = [RowLayer(k, v, store.lengths, store.index, span) for k, v in zip(store.keys, store.values)]
            super().__init__(layers=layers)
            self.span = span
            self.lengths = store.lengths
            self.live = store.live

    class PromptWindow(Cache):
        """What a joined prompt forward of ``span`` positions writes through, as a ``Cache``."""

        def __init__(self, store: RowStore, span: int):
            layers = [PromptLayer(k, v, store.lengths, store.index, span, store.slots)
                      for k, v in zip(store.keys, store.values)]
            super().__init__(layers=layers)
            self.span = span
            self.lengths, self.live, self.slots = store.lengths, store.live, store.slots

    return RowWindow, PromptWindow


def _layer_classes():
    from transformers.cache_utils import CacheLayerMixin

    class RowLayer(CacheLayerMixin):
        """One layer of a window: each row's new key goes at that row's own length."""

        is_compileable = True
        is_sliding = False

        def __init__(self, keys: Tensor, values: Tensor, lengths: Tensor, index: Tensor, span: int):
            super().__init__()
            self.keys, self.values, self.lengths, self.index = keys, values, lengths, index
            self.span = span
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states, *args, **kwargs):
            pass

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
            n = key_states.shape[0]
            rows, pos = self.index[:n], self.lengths[:n]
            self.keys[rows, :, pos] = key_states[:, :, -1].to(self.keys.dtype)
            self.values[rows, :, pos] = value_states[:, :, -1].to(self.values.dtype)
            return self.keys[:n, :, :self.span], self.values[:n, :, :self.span]

        def get_mask_sizes(self, *args, **kwargs):
            return self.span, 0

        def get_seq_length(self, *args, **kwargs):
            return self.span - 1

        def get_max_length(self, *args, **kwargs):
            return self.span

        def get_max_cache_shape(self, *args, **kwargs):
            return self.span

        def reset(self):
            pass

    class PromptLayer(RowLayer):
        """One layer of a prompt window: the prompts' keys go into their rows, from position 0."""

        def __init__(self, keys, values, lengths, index, span, slots):
            super().__init__(keys, values, lengths, index, span)
            self.slots = slots

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
            k, width = key_states.shape[0], key_states.shape[2]
            rows = self.slots[:k]
            self.keys[rows, :, :width] = key_states.to(self.keys.dtype)
            self.values[rows, :, :width] = value_states.to(self.values.dtype)
            return key_states, value_states

        def get_seq_length(self, *args, **kwargs):
            return 0

    return RowLayer, PromptLayer
