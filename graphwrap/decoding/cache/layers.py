"""The transformers ``Cache`` classes through which the model writes and reads the shared
batch's cache: a step's window, a joined prompt forward's window and a long prompt's piece, for
each layout (:mod:`.rows`, :mod:`.pages`). Imported only when a store makes a window (this
module needs transformers)."""

from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..kernels import step_write
from . import fp8
from .pool import blocks_for

Tensor = torch.Tensor


class WindowLayer(CacheLayerMixin):
    """What every layer of a window answers: ``span`` positions, already allocated (``scales``:
    the layer's FP8 scales where its pools are FP8, see :mod:`.fp8`; None in the model's dtype)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: Tensor, values: Tensor, span: int):
        super().__init__()
        self.keys, self.values = keys, values
        self.span = span
        self.is_initialized = True
        self.scales: Optional[fp8.Scales] = getattr(keys, "_gw_scales", None)

    def read(self, got: Tensor, values: bool, dtype: torch.dtype) -> Tensor:
        """Positions gathered from the pool of keys (of values), in ``dtype``: read back from FP8
        with the layer's scale where the pool is FP8."""
        if self.scales is None:
            return got
        return fp8.decode(got, self.scales.values if values else self.scales.keys, dtype)

    def lazy_initialization(self, key_states, value_states, *args, **kwargs):
        pass

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


class RowLayer(WindowLayer):
    """One layer of a window: each row's new key goes at that row's own length."""

    def __init__(self, keys: Tensor, values: Tensor, lengths: Tensor, index: Tensor, span: int):
        super().__init__(keys, values, span)
        self.lengths, self.index = lengths, index

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        n = key_states.shape[0]
        rows, pos = self.index[:n], self.lengths[:n]
        self.keys[rows, :, pos] = key_states[:, :, -1].to(self.keys.dtype)
        self.values[rows, :, pos] = value_states[:, :, -1].to(self.values.dtype)
        return self.keys[:n, :, :self.span], self.values[:n, :, :self.span]


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


class ChunkLayer(WindowLayer):
    """One layer of a piece of a long prompt in a whole row: its keys go at ``[start, end)``,
    and attention sees the row's ``[0, end)``."""

    def __init__(self, keys, values, row: int, start: int, width: int):
        super().__init__(keys, values, start + width)
        self.row, self.start, self.end = row, start, start + width

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        r, a, b = self.row, self.start, self.end
        self.keys[r, :, a:b] = key_states[0].to(self.keys.dtype)
        self.values[r, :, a:b] = value_states[0].to(self.values.dtype)
        return self.keys[r:r + 1, :, :b], self.values[r:r + 1, :, :b]

    def get_seq_length(self, *args, **kwargs):
        return self.start


class StepSlots:
    """Where a step's rows write their new keys (block, offset) and, where the attention reads the
    pool in place, how many positions each row sees (``seen``: its length and the key this step
    writes), shared by one window's layers: the first layer of a forward finds them, once."""

    where: Tensor
    offset: Tensor
    seen: Optional[Tensor] = None
    splits: int = 1  # programs the attention splits each row's positions between (paged_attention.splits_for)
    work: Optional[dict] = None  # where it splits, the forward's rows' tiles summed by (head width, window)
    piece: tuple  # a mixed forward's piece: its row's line, and where its positions go (block, offset)


class PagedLayer(RowLayer):
    """One layer of a paged window: each row's new key goes at its own length; then either the
    pools themselves go to graphwrap's attention (``store.direct``), or the rows' blocks of the
    window are gathered for the model's own. The first layer of a forward finds each row's
    block and offset from the lengths (which no layer changes), and the positions each row sees;
    the others reuse them: a step's graph holds those few kernels once, not once a layer."""

    def __init__(self, keys: Tensor, values: Tensor, store, span: int, direct: Optional[Tensor] = None,
                 slots: Optional[StepSlots] = None, first: bool = True):
        super().__init__(keys, values, store.lengths, store.index, span)
        self.store, self.table, self.block = store, store.table, store.block
        self.lines = span // store.block
        self.slots = slots if slots is not None else StepSlots()
        self.first = first or slots is None
        # The pool as the attention reads it in place: a view marked with the store, the layer's
        # window and this window's slots (whose ``seen`` the first layer finds).
        self.direct = _marked(direct, _gw_slots=self.slots) if direct is not None else None

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        n = key_states.shape[0]
        slots = self.slots
        direct = self.store.base.direct
        if self.first:
            slots.where, slots.offset, pos = _row_slots(self, n)
            slots.seen = pos + 1 if direct else None
            slots.work = None  # (this forward's: found by its first attention that splits)
        where, offset = slots.where, slots.offset
        step_write.put(self.keys, self.values, where, offset, key_states[:, :, -1], value_states[:, :, -1],
                       self.scales)
        if direct:
            return self.direct, self.values
        dtype = key_states.dtype
        return self.read(self._gather(self.keys, n), False, dtype), self.read(self._gather(self.values, n), True, dtype)

    def _gather(self, pool: Tensor, n: int) -> Tensor:
        lines = self.table[:n, :self.lines]
        return pool[lines].view(n, self.span, pool.shape[2], pool.shape[3]).transpose(1, 2)


def _row_slots(layer: "PagedLayer", n: int):
    """``(block, offset, position)`` of the next key of each of a step's first ``n`` rows."""
    pos = layer.lengths[:n]
    return layer.table[:n].gather(1, (pos // layer.block)[:, None])[:, 0], pos % layer.block, pos


def _piece_slots(store, steps: Tensor):
    """``(line, block, offset)`` of a piece's positions (``steps``: ``arange(width)``) in the row
    of the store's ``at`` (start, valid positions, row): the row's blocks, and where each position
    goes, the padding past the valid ones into the row's own scratch block (its number)."""
    at = store.at
    line = store.table.index_select(0, at[2:3])[0]
    pos = (at[0] + steps).clamp_(max=store.per_row * store.block - 1)
    return line, torch.where(steps < at[1], line[pos // store.block], at[2]), pos % store.block


def _marked(pool: Tensor, **marks) -> Tensor:
    """A view of ``pool`` with its marks (``_gw_...``: what the attention reads the pool by) and
    ``marks`` added."""
    view = pool.view(pool.shape)
    for name, value in list(vars(pool).items()) + list(marks.items()):
        if name.startswith("_gw_"):
            setattr(view, name, value)
    return view


class PagedPromptLayer(RowLayer):
    """One layer of a paged prompt window: the prompts' keys go into their rows' blocks, from
    position 0 (padding past a row's blocks into the scratch block)."""

    def __init__(self, keys: Tensor, values: Tensor, store, width: int):
        super().__init__(keys, values, store.lengths, store.index, width)
        self.table, self.slots = store.table, store.slots
        self.pos_block, self.pos_offset = store.pos_block[:width], store.pos_offset[:width]

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        k, width = key_states.shape[0], key_states.shape[2]
        where = self.table.index_select(0, self.slots[:k])[:, self.pos_block[:width]]
        offset = self.pos_offset[:width]
        step_write.put(self.keys, self.values, where, offset, key_states.transpose(1, 2), value_states.transpose(1, 2),
                       self.scales)
        return key_states, value_states

    def get_seq_length(self, *args, **kwargs):
        return 0


class PagedChunkLayer(WindowLayer):
    """One layer of a piece of a long prompt in a paged row: its keys go at ``[start, end)``
    of the row's blocks, and attention sees the row's ``[0, end)``, gathered."""

    def __init__(self, keys: Tensor, values: Tensor, store, row: int, start: int, width: int):
        super().__init__(keys, values, start + width)
        end = start + width
        self.start, self.end = start, end
        line = store.table[row]
        self.where = line[store.pos_block[start:end]]
        self.offset = store.pos_offset[start:end]
        self.lines = line[:blocks_for(end, store.block)]

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        step_write.put(self.keys, self.values, self.where, self.offset, key_states[0].transpose(0, 1),
                       value_states[0].transpose(0, 1), self.scales)
        dtype = key_states.dtype
        return self.read(self._seen(self.keys), False, dtype), self.read(self._seen(self.values), True, dtype)

    def _seen(self, pool: Tensor) -> Tensor:
        got = pool[self.lines].flatten(0, 1)[:self.end]  # [end, heads, dim]
        return got.transpose(0, 1)[None]

    def get_seq_length(self, *args, **kwargs):
        return self.start


class PagedPieceLayer(WindowLayer):
    """One layer of a piece of a long prompt in a paged row, as a graph runs it: the piece's place
    comes from the store's ``at`` (start, valid positions, row: written by the forward from its
    input); its keys go at ``[start, start + valid)`` of the row's blocks (the padding after them
    into the row's own scratch block), and attention sees the row's first ``span`` positions,
    gathered (the mask hides what the piece may not see), or, where the store's attention reads
    the pool (``direct``), the pools themselves go to it, marked with the row's line and ``at``
    (:mod:`.piece_attention`)."""

    def __init__(self, keys: Tensor, values: Tensor, store, width: int, span: int, window: Optional[int] = None):
        super().__init__(keys, values, span)
        self.store, self.width, self.window = store, width, window
        self.lines = span // store.block
        self.steps = torch.arange(width, device=store.device)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        store = self.store
        at = store.at
        line, where, offset = _piece_slots(store, self.steps)
        step_write.put(self.keys, self.values, where, offset, key_states[0].transpose(0, 1),
                       value_states[0].transpose(0, 1), self.scales)
        if store.base.direct:  # the pools themselves, marked with the row's line and the piece's place
            view = self.keys.view(self.keys.shape)
            setattr(view, "_gw_piece", (line, at))
            setattr(view, "_gw_window", self.window)
            setattr(view, "_gw_scales", self.scales)
            return view, self.values
        seen = line[:self.lines]
        dtype = key_states.dtype
        return (self.read(self._seen(self.keys, seen), False, dtype),
                self.read(self._seen(self.values, seen), True, dtype))

    def _seen(self, pool: Tensor, seen: Tensor) -> Tensor:
        return pool[seen].flatten(0, 1).transpose(0, 1)[None]  # [1, heads, span, dim]

    def get_seq_length(self, *args, **kwargs):
        return 0


class PagedMixedLayer(PagedLayer):
    """One layer of a mixed forward (:class:`~.step.MixedStep`): the first ``n`` of its positions
    are the rows' next tokens, each written at its row's length (as :class:`PagedLayer` writes a
    step's), then the piece's ``width`` at its row's ``[start, start + valid)`` (the padding into
    the row's scratch block), in that order: where the piece's row is among the ``n`` (not live,
    its length the piece's start), the piece's key is what stays there. The attention gets the
    pools, marked with both (its queries split between the step's kernel and the piece's)."""

    def __init__(self, keys: Tensor, values: Tensor, store, span: int, width: int, direct: Tensor,
                 slots: StepSlots, first: bool):
        super().__init__(keys, values, store, span, direct, slots, first)
        self.width = width
        self.steps = torch.arange(width, device=store.device)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        width = self.width
        n = key_states.shape[2] - width
        slots, store = self.slots, self.store
        if self.first:
            slots.where, slots.offset, pos = _row_slots(self, n)
            slots.seen = pos + 1
            slots.piece = _piece_slots(store, self.steps)
            slots.work = None
        k, v = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)  # [n + width, heads, dim]
        step_write.put(self.keys, self.values, slots.where, slots.offset, k[:n], v[:n], self.scales)
        line, where, offset = slots.piece
        step_write.put(self.keys, self.values, where, offset, k[n:], v[n:], self.scales)
        setattr(self.direct, "_gw_mixed", (n, line, store.at))
        return self.direct, self.values


class MixedWindow(Cache):
    """What a mixed forward of ``n`` rows and a piece of ``width`` positions writes through and
    attends over, as a ``Cache`` (one per shape: a graph over it replays)."""

    def __init__(self, store, width: int, layers: list):
        super().__init__(layers=layers)
        self.width = width
        self.lengths, self.live, self.at = store.lengths, store.live, store.at
        self.capture_restores = [store.lengths, store.live, store.at]


class PieceWindow(Cache):
    """What a piece of a long prompt writes through and attends over, as a ``Cache`` (one per
    piece shape: a graph over it replays for any piece of that shape)."""

    def __init__(self, store, layers: list):
        super().__init__(layers=layers)
        self.at = store.at
        self.capture_restores = [store.at]


class RowWindow(Cache):
    """The first ``span`` positions of every row of a store, as a ``Cache``."""

    def __init__(self, store, span: int, layers: list):
        super().__init__(layers=layers)
        self.span = getattr(layers[0], "span", span) if layers else span
        self.lengths = store.lengths
        self.live = store.live
        self.store = store
        # What a capture puts back after each of its runs: every run of one step writes the same
        # keys at the same places, so the cache itself (far too large to copy) is left.
        self.capture_restores = [store.lengths, store.live]

    @property
    def in_place(self) -> bool:
        """Whether a forward now hands the attention the paged pool itself (which reads each row
        to its own length, never a mask: see :class:`~.attention.folding`)."""
        base = getattr(self.store, "base", None)
        return bool(getattr(base, "direct", False))


class PromptWindow(Cache):
    """What a joined prompt forward of ``span`` positions writes through, as a ``Cache``."""

    def __init__(self, store, span: int, layers: list):
        super().__init__(layers=layers)
        self.span = span
        self.lengths, self.live, self.slots = store.lengths, store.live, store.slots
        self.capture_restores = [store.lengths, store.live, store.slots]


class ChunkWindow(Cache):
    """What one piece of a long prompt writes through and attends over, as a ``Cache``."""

    def __init__(self, start: int, layers: list):
        super().__init__(layers=layers)
        self.start = start
