"""The prompt's forward (prefill) and the decode step of the shared batch.

The step is a module of its own (:class:`DecodeStep`) that graphwrap's engine captures like any
other: its inputs are the rows' next tokens ``[n, 1]`` and a window of the cache of rows (state
the graph writes in place: a key per window, never copied or padded); inside, it builds each
row's mask and position from the rows' lengths, runs the model over the window and moves the
live rows' lengths on. One graph per (row bucket, span bucket); nothing in a step depends on
the host but which graph replays.

Prompts are joined into one forward (:class:`PrefillStep`), right-padded to a (rows, width)
bucket, written straight into the rows they took (a row's padded positions are masked, and
written over by its first steps), one graph per bucket as well. A prompt longer than
:data:`CHUNK` goes in pieces (:class:`ChunkStep`, eager: its cost is compute), one piece a turn
between the steps of the other rows, so a long prompt does not stall them; its first token
comes from the last piece.
"""

import inspect
from typing import List, Optional, Tuple

import torch
from torch import nn

from ...loops.decode import cache_keyword
from ..cache import fp8
from ..cache.rows import row_mask, to_device
from .scheduler import bucket_of, buckets_upto

Tensor = torch.Tensor
CHUNK = 512  # positions of a prompt's piece: longer prompts are prefilled a piece a turn


def model_positions(config) -> Optional[int]:
    """How many positions the model has, where its config says."""
    return next((getattr(config, a) for a in ("max_position_embeddings", "n_positions", "max_sequence_length")
                 if isinstance(getattr(config, a, None), int)), None)


class ModelForward(nn.Module):
    """What the batch's forwards of the model share: the model, the keyword it takes its cache
    by, the masks its kinds of layer take, and its last position."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.cache_name = cache_keyword(model)
        self.masks = Masks(layer_windows(model))
        self.training = model.training  # not train(): that would set the model's own flags
        positions = model_positions(getattr(model, "config", None))
        self.last_position = positions - 1 if positions else None

    def within(self, pos: Tensor) -> Tensor:
        """A piece's positions, its padding's held to the model's last (a table of positions,
        GPT-2's, has no row past it; a padded position's key goes to a scratch block, unread)."""
        return pos.clamp(max=self.last_position) if self.last_position is not None else pos


class DecodeStep(ModelForward):
    """One decode step of every row of a window: ``[n, 1]`` next tokens -> ``[n, vocab]`` logits."""

    def forward(self, input_ids: Tensor, rows) -> Tensor:
        n = input_ids.shape[0]
        lengths = rows.lengths[:n]
        # (where the attention reads the pool in place it reads each row to its length and no mask:
        # the model is handed one of one position, not rows x the whole window)
        span = 1 if getattr(rows, "in_place", False) else rows.span
        mask = self.masks(row_mask, lengths, span, _mask_dtype(self.model))
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=lengths[:, None].clone(),
                         use_cache=True, return_dict=True, **{self.cache_name: rows})
        rows.lengths[:n] += rows.live[:n]
        return out.logits[:, -1]


def _mask_dtype(model) -> torch.dtype:
    p = next(model.parameters(), None)
    return p.dtype if p is not None and p.dtype.is_floating_point else torch.float32


class PrefillStep(ModelForward):
    """A joined forward of right-padded prompts into their rows: ``[k, width]`` token ids, each
    prompt's length and row -> each prompt's last logits ``[k, vocab]``. Padding prompts (length
    1) write the scratch row. Where the model takes ``logits_to_keep``, its head runs over each
    prompt's last position in every row (``k x k`` positions, not ``k x width``: on a Llama-3-8B
    shape a forward of 16 prompts of 256 made 4,096 positions' logits, 1 GB in fp16, to use 16
    of them) and the diagonal is kept."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.keeps = bool(_last_logits(model))

    def forward(self, input_ids: Tensor, lengths: Tensor, slots: Tensor, rows) -> Tensor:
        k, width = input_ids.shape
        rows.slots[:k].copy_(slots)
        mask = self.masks(prompt_mask, lengths, width, _mask_dtype(self.model))
        pos = torch.arange(width, device=input_ids.device)[None, :].expand(k, width)
        last = lengths - 1
        extra = {"logits_to_keep": last} if self.keeps else {}
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         return_dict=True, **extra, **{self.cache_name: rows})
        rows.lengths.index_copy_(0, slots, lengths)
        rows.live.index_fill_(0, slots, 1)
        every = torch.arange(k, device=input_ids.device)
        return out.logits[every, every if self.keeps else last]


class ChunkStep(ModelForward):
    """One piece of a long prompt in its row, run eagerly: ``[1, width]`` token ids from position
    ``start`` -> the piece's last logits ``[1, vocab]``. The piece sees the row's earlier
    positions and its own, causally."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.last = _last_logits(model)

    def forward(self, input_ids: Tensor, start: int, rows) -> Tensor:
        width = input_ids.shape[1]
        mask = self.masks(chunk_mask, start, width, _mask_dtype(self.model), input_ids.device)
        pos = torch.arange(start, start + width, device=input_ids.device)[None]
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True, return_dict=True,
                         **self.last, **{self.cache_name: rows})
        return out.logits[:, -1]


class WholeStep(ModelForward):
    """A long prompt in one eager forward into its row (:func:`.pieces.goes_whole`):
    ``[1, L]`` token ids and ``slot`` ``[1]`` (its row, on the device) -> the logits of its last
    position ``[1, vocab]``. The model is given no mask and no positions, as for a prompt in a
    fresh cache with every position valid: it builds its own mask, or none where its attention
    takes ``is_causal`` (the fused kernels of ``model.generate``'s prefill), with no read of a
    device tensor on the host (an all-ones mask would be read); the layers write each key into
    the row (:class:`~..cache.layers.PromptLayer`, :class:`~..cache.layers.PagedPromptLayer`)."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.last = _last_logits(model)

    def forward(self, input_ids: Tensor, slot: Tensor, rows) -> Tensor:
        rows.slots[:1].copy_(slot)
        out = self.model(input_ids=input_ids, use_cache=True, return_dict=True, **self.last, **{self.cache_name: rows})
        return out.logits[:, -1]


class PieceStep(ModelForward):
    """One piece of a long prompt in its row, as a graph runs it: ``[1, width]`` token ids (the
    piece, right-padded) and ``at`` ``[3]`` (its start, its valid positions, its row: on the
    device) -> the logits of its last valid position ``[1, vocab]``. The piece sees its row's
    earlier positions and its own, causally, within a window of ``span`` positions of the row.
    Where the model takes ``logits_to_keep``, its head runs over that position alone."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.keeps = bool(_last_logits(model))

    def forward(self, input_ids: Tensor, at: Tensor, rows) -> Tensor:
        width = input_ids.shape[1]
        rows.at.copy_(at)
        span = rows.layers[0].span
        start = rows.at[0]
        mask = self.masks(piece_mask, start, width, span, _mask_dtype(self.model))
        pos = self.within(start + torch.arange(width, device=input_ids.device))[None]
        last = rows.at[1:2] - 1
        extra = {"logits_to_keep": last} if self.keeps else {}
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True, return_dict=True,
                         **extra, **{self.cache_name: rows})
        return out.logits[0] if self.keeps else out.logits[0].index_select(0, last)


class MixedStep(ModelForward):
    """A decode step of the first ``n`` rows and a piece of a long prompt in one forward, where
    the attention reads the paged pool in place: ``[1, n + W]`` tokens (the rows' next tokens,
    then the piece's ``W``, right-padded) and ``at`` ``[3]`` (the piece's start, valid positions
    and row, on the device) -> ``[n + 1, vocab]``: each row's logits, then those of the piece's
    last valid position. Every token goes through the model at its own position, so the weights
    are read once for both; the layers (:class:`~.layers.PagedMixedLayer`) write the rows' new
    keys, then the piece's, and the attention gives the rows' queries to the step's kernel and the
    piece's to the piece's (:func:`~.attention.folded_sdpa`)."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.keeps = bool(_last_logits(model))

    def forward(self, input_ids: Tensor, at: Tensor, rows) -> Tensor:
        total = input_ids.shape[1]
        width = rows.width
        n = total - width
        rows.at.copy_(at)
        device = input_ids.device
        steps = torch.arange(width, device=device)
        pos = torch.cat([rows.lengths[:n], self.within(rows.at[0] + steps)])[None]
        mask = self.masks(one_position, total, _mask_dtype(self.model), device)  # (read in place: no mask is read)
        keep = torch.cat([torch.arange(n, device=device), n + rows.at[1:2] - 1])
        extra = {"logits_to_keep": keep} if self.keeps else {}
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True, return_dict=True,
                         **extra, **{self.cache_name: rows})
        logits = out.logits[0] if self.keeps else out.logits[0].index_select(0, keep)
        rows.lengths[:n] += rows.live[:n]
        return logits


def one_position(total: int, dtype: torch.dtype, device, window: Optional[int] = None) -> Tensor:
    """The additive 4-D mask ``[1, 1, total, 1]`` handed to a model whose attention reads no mask."""
    return torch.zeros((1, 1, total, 1), dtype=dtype, device=device)


def piece_mask(start: Tensor, width: int, span: int, dtype: torch.dtype, window: Optional[int] = None) -> Tensor:
    """The additive 4-D mask ``[1, 1, width, span]`` of a piece from position ``start`` (a device
    scalar): query ``i`` sees positions up to ``start + i`` (and, with a window, after
    ``start + i - window``)."""
    q = torch.arange(width, device=start.device)[:, None] + start
    kv = torch.arange(span, device=start.device)[None, :]
    seen = kv <= q
    if window:
        seen = seen & (kv > q - window)
    zero = torch.zeros((), dtype=dtype, device=start.device)
    return torch.where(seen, zero, torch.finfo(dtype).min)[None, None]


def chunk_mask(start: int, width: int, dtype: torch.dtype, device, window: Optional[int] = None) -> Tensor:
    """The additive 4-D mask ``[1, 1, width, start + width]`` of a piece of a prompt: query ``i``
    sees positions up to ``start + i`` (and, with a window, after ``start + i - window``)."""
    q = torch.arange(width, device=device)[:, None] + start
    kv = torch.arange(start + width, device=device)[None, :]
    seen = kv <= q
    if window:
        seen = seen & (kv > q - window)
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(seen, zero, torch.finfo(dtype).min)[None, None]


def _last_logits(model) -> dict:
    """``logits_to_keep=1`` where the model's forward takes it (the head over one position, not
    the whole piece)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


class Prompts:
    """How waiting prompts are joined: by length, at most ``max_rows`` and ``max_tokens`` (padded)
    a forward, each forward's shape a (rows, width) bucket."""

    def __init__(self, rows: int, max_len: int, scratch: int, max_rows: int = 16, max_tokens: int = 4096):
        self.row_buckets = buckets_upto(min(max_rows, rows), (1, 2, 4, 8, 16))
        self.width_buckets = buckets_upto(max_len, (16, 32, 64, 128, 256))
        self.max_tokens, self.scratch = max_tokens, scratch

    def shape(self, prompts: List[List[int]]) -> Tuple[int, int]:
        return bucket_of(len(prompts), self.row_buckets), bucket_of(max(len(p) for p in prompts), self.width_buckets)

    def groups(self, prompts: List[List[int]]) -> List[List[int]]:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: List[List[int]] = []
        cur: List[int] = []
        for i in order:
            cand = cur + [i]
            if cur and (len(cand) > self.row_buckets[-1]
                        or _padded(self.shape([prompts[j] for j in cand])) > self.max_tokens):
                out.append(cur)
                cand = [i]
            cur = cand
        if cur:
            out.append(cur)
        return out

    def inputs(self, prompts: List[List[int]], rows: List[int], shape: Tuple[int, int], device):
        """``(input_ids, lengths, slots)`` of one forward, padded to ``shape``, on ``device``
        (built on the host and copied in one piece)."""
        k, width = shape
        host = torch.zeros((k, width + 2), dtype=torch.long)
        for i, p in enumerate(prompts):
            host[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        host[:, width] = 1
        host[:len(prompts), width] = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        host[:, width + 1] = self.scratch
        host[:len(rows), width + 1] = torch.tensor(rows, dtype=torch.long)
        t = to_device(host, device)
        return t[:, :width], t[:, width], t[:, width + 1]


def _padded(shape: Tuple[int, int]) -> int:
    return shape[0] * shape[1]


def cache_layout(model, device):
    """One eager forward of one token: the model's own cache's per-layer keys and values, whose
    shapes and dtypes the rows take (None where it has no such layers)."""
    with torch.no_grad():
        one = torch.ones((1, 1), dtype=torch.long, device=device)
        out = model(input_ids=one, attention_mask=one, use_cache=True, return_dict=True)
    return _layers(output_cache(out))


def kv_scales(model, device, n: int) -> List["fp8.Scales"]:
    """Each layer's FP8 scales (:mod:`..cache.fp8`) from one eager forward of the calibration
    prompt of ``n`` tokens through the model's own cache."""
    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    ids = torch.tensor([fp8.calibration_ids(vocab, n)], dtype=torch.long, device=device)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, return_dict=True)
    keys, values = _layers(output_cache(out))
    if keys is None or values is None:
        raise ValueError("the model's own cache has no per-layer keys and values to take scales from")
    return fp8.scales_for([float(k.abs().amax()) for k in keys], [float(v.abs().amax()) for v in values])


def output_cache(out):
    """The cache a forward returned: ``out.cache`` from transformers 5.24 (where reading
    ``past_key_values`` warns that it is deprecated), ``out.past_key_values`` before."""
    keys = out.keys() if callable(getattr(out, "keys", None)) else ()
    if "cache" in keys:
        return out["cache"]
    return getattr(out, "past_key_values", None)


def prompt_mask(lengths: Tensor, P: int, dtype: torch.dtype, window: Optional[int] = None) -> Tensor:
    """The additive 4-D mask ``[k, 1, P, P]`` of right-padded prompts: causal, and no row sees a
    padded key. Given 4-D, the model uses it as it is, as it does the decode step's mask (no
    release's own mask code in between; the probe checks both). Without a window it is marked
    ``_gw_causal``: at each prompt's own positions it says what causal alone says (the padding
    is past them), so graphwrap's attention may run the fused causal kernel instead
    (:func:`~..kernels.attention.folded_sdpa`); a padded position's output differs, and is never
    read (its key is written over before a step attends to it)."""
    pos = torch.arange(P, device=lengths.device)
    causal = pos[None, :] <= pos[:, None]
    if window:
        causal = causal & (pos[None, :] > pos[:, None] - window)
    seen = causal[None] & (pos[None, None, :] < lengths[:, None, None])
    zero = torch.zeros((), dtype=dtype, device=lengths.device)
    mask = torch.where(seen, zero, torch.finfo(dtype).min)[:, None]
    if not window:
        mask._gw_causal = True  # type: ignore[attr-defined]
    return mask


def _layers(cache):
    layers = getattr(cache, "layers", None)
    if not layers or any(getattr(lay, "keys", None) is None for lay in layers):
        return None, None
    if _windows(layers) is None:
        return None, None
    return [lay.keys for lay in layers], [lay.values for lay in layers]


def layer_windows(model) -> Optional[List[Optional[int]]]:
    """Each layer's sliding window (None: full attention), as the model's own cache makes its
    layers (``DynamicCache(config=...)``); None where a layer is of another kind."""
    try:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    except Exception:  # noqa: BLE001 - a model whose cache is not transformers' dynamic one
        return None
    return _windows(getattr(cache, "layers", None) or [])


def _windows(layers) -> Optional[List[Optional[int]]]:
    out: List[Optional[int]] = []
    for lay in layers:
        if not getattr(lay, "is_sliding", False):
            out.append(None)
        elif isinstance(getattr(lay, "sliding_window", None), int) and type(lay).__name__ == "DynamicSlidingWindowLayer":
            out.append(lay.sliding_window)
        else:
            return None
    return out


class Masks:
    """The 4-D masks a forward gives the model: one where every layer attends alike (all full,
    or all within one sliding window), else one per kind of layer, keyed as transformers' hybrid
    models take them (``full_attention``, ``sliding_attention``)."""

    def __init__(self, windows: Optional[List[Optional[int]]]):
        kinds = set(windows or [None])
        self.window = next((w for w in kinds if w), None)
        self.hybrid = len(kinds) > 1
        if len(kinds - {None}) > 1:
            raise ValueError(f"layers with different sliding windows ({sorted(w for w in kinds if w)})")

    def __call__(self, make, *args):
        if not self.hybrid:
            return make(*args, window=self.window)
        return {"full_attention": make(*args), "sliding_attention": make(*args, window=self.window)}
