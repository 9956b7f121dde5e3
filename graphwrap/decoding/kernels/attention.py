"""Grouped-query attention of the shared batch's forwards without repeating keys and values.

transformers' ``sdpa`` attention repeats each key and value head once per query head of its
group whenever an attention mask is given (PyTorch's fused kernels take a mask and grouped
heads together only through the slow reference kernel). The batch's forwards always have a
mask (each row its own length), so at 64 rows a 1.1B Llama step wrote and read its whole window
of keys eight times over, and each 128-position piece of a long prompt on a Llama-3-8B shape
spent a fifth of its time repeating (``benchmarks/diagnostics/piece_profile.py``). There is a
cheaper equivalent: the ``G`` query heads that share a key head become ``G`` times as many query
positions of that key head, each under its position's row of the mask (the mask's rows repeated
``G`` times: a step's one row, or a piece's ``n``), and the fused kernels run as they are.

The batch's joined prompts (masks marked by ``step.prompt_mask``: no sliding window) take
PyTorch's fused causal kernel with grouped heads and no mask instead: right-padded from position
0, at each prompt's own positions causal alone says what the mask says, and the fold would copy
the query, the mask and the output (three copies of the forward's size a layer) to run the
slower masked kernel.

:func:`folding` sets the model's attention to that function around the calls the shared batch
makes (its captures and any eager forward); where the fold does not apply (a mask per head, a
mask not one row per query position, a position bias) the function is transformers' ``sdpa``
itself, so a caller that runs the model meanwhile, on another thread, gets ``sdpa``'s answers
either way. transformers 5.24's own ``sdpa`` folds a single query position the same way
(``pack_gqa``); with it, the model's attention is left as it is unless steps read the paged pool
straight (then the function here serves every forward of the batch).

:class:`without_cudnn` keeps torch's attention off its cuDNN backend around the batch's eager
forwards and its captures (see there).
"""

import threading
from typing import List, Optional

import torch
from torch.nn import functional as F

from . import fused

NAME = "graphwrap_folded_sdpa"
_REGISTERED = threading.Lock()
_DONE: List[bool] = []  # whether the function is registered, decided once


def folded_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: Optional[float] = None,
                is_causal=None, position_bias=None, **kwargs):
    """transformers' attention-function signature: ``query [b, hq, q, d]``, ``key``/``value``
    ``[b, hkv, k, d]`` -> ``([b, q, hq, d], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mixed = getattr(key, "_gw_mixed", None)
    if mixed is not None:  # a step's rows and a piece in one forward over the pool (see PagedMixedLayer)
        return _mixed(query, key, value, mixed, scaling, getattr(key, "_gw_window", None), kwargs.get("softcap")), None
    piece = getattr(key, "_gw_piece", None)
    if piece is not None:  # a piece of a long prompt over the paged pool itself (see PagedPieceLayer)
        from .piece_attention import attend_piece

        line, at = piece
        return attend_piece(query, key, value, line, at, scaling, getattr(key, "_gw_window", None),
                            kwargs.get("softcap"), getattr(key, "_gw_scales", None)), None
    store = getattr(key, "_gw_pages", None)
    if store is not None:  # the paged pool itself (see PagedLayer): each row over its own blocks
        from .paged_attention import attend, splits_at

        n = query.shape[0]
        slots = getattr(key, "_gw_slots", None)  # (each row's positions, found once a forward)
        seen = slots.seen if slots is not None and slots.seen is not None else store.lengths[:n] + 1
        splits = splits_at(slots.splits if slots is not None else 1, n, key.shape[2], query.device)
        window = getattr(key, "_gw_window", None)
        return attend(query, key, value, store.table[:n], seen, scaling, window, kwargs.get("softcap"), splits,
                      getattr(key, "_gw_scales", None), _work(slots, seen, query.shape[-1], window, key.shape[2])), None
    if getattr(attention_mask, "_gw_causal", False) and _causal(module, query, key, position_bias, kwargs):
        # (joined prompts from position 0, right-padded: the fused causal kernel, no mask and no copies)
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=True,
                                             enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2).contiguous(), None
    if not _folds(module, query, key, attention_mask, position_bias, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, position_bias=position_bias, **kwargs)
    b, hq, n, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    q = query.reshape(b, hkv, groups * n, d)  # a key head's query heads as its query positions
    if n > 1:  # (each query head of the group under its positions' rows of the mask)
        mask = attention_mask
        attention_mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(mask.shape[0], 1, groups * n, -1)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
    return out.reshape(b, hq, n, value.shape[-1]).transpose(1, 2).contiguous(), None


def _mixed(query, key, value, mixed, scaling, window, softcap):
    """``query [1, hq, n + W, d]`` of a mixed forward: the first ``n`` positions (a row each) by
    the step's kernel over each row's own positions, the last ``W`` by the piece's over its
    row's -> ``[1, n + W, hq, d]``."""
    from .paged_attention import attend, splits_at
    from .piece_attention import attend_piece

    n, line, at = mixed
    slots = key._gw_slots
    store = key._gw_pages
    scales = getattr(key, "_gw_scales", None)
    rows = attend(query[0, :, :n].transpose(0, 1)[:, :, None], key, value, store.table[:n], slots.seen, scaling,
                  window, softcap, splits_at(slots.splits, n, key.shape[2], query.device), scales,
                  _work(slots, slots.seen, query.shape[-1], window, key.shape[2]))  # [n, 1, hq, d]
    piece = attend_piece(query[:, :, n:], key, value, line, at, scaling, window, softcap, scales)  # [1, W, hq, d]
    return torch.cat([rows.transpose(0, 1), piece], dim=1)


def _work(slots, seen, d: int, window, key_heads: int):
    """The forward's rows' tiles summed (``paged_attention.work_of``) where its window splits each
    row past ``SPLIT_FROM`` positions and its rows balance (``paged_attention.balances``): found by
    its first layer that attends with the head width and window, and handed to the rest; None
    elsewhere (the split as the window says), and while ``torch.compile`` traces."""
    from .paged_attention import balances, work_of

    if (slots is None or slots.splits <= 1 or not seen.is_cuda or torch.compiler.is_compiling()
            or not balances(seen.shape[0], key_heads, seen.device)):
        return None
    if slots.work is None:
        slots.work = {}
    key = (d, window)
    work = slots.work.get(key)
    if work is None:
        work = slots.work[key] = work_of(seen, d, window)
    return work


def _causal(module, query, key, position_bias, kwargs) -> bool:
    """Whether a forward of joined prompts (its mask marked ``_gw_causal`` by ``step.prompt_mask``)
    may take causal attention alone: its keys are its own positions, its query heads whole
    groups of its key heads, and nothing but the mask shapes its scores (no position bias, soft
    cap, sliding window or sinks)."""
    return (query.shape[2] == key.shape[2] and query.shape[1] % key.shape[1] == 0 and position_bias is None
            and getattr(module, "is_causal", True) is True and not kwargs.get("output_attentions", False)
            and all(kwargs.get(k) is None for k in ("softcap", "sliding_window", "s_aux", "sinks")))


def _folds(module, query, key, mask, position_bias, kwargs) -> bool:
    groups = getattr(module, "num_key_value_groups", 1)
    n = query.shape[2]
    # (many positions: the mask repeated per head must not outweigh the keys and values it spares,
    # n x span x G against 2 x span x G x hkv x d: n up to 2 x hkv x d)
    return (isinstance(groups, int) and groups > 1 and key.shape[1] * groups == query.shape[1]
            and isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == 1
            and mask.shape[2] == n and mask.shape[0] in (1, query.shape[0]) and n <= 2 * key.shape[1] * key.shape[3]
            and position_bias is None and not kwargs.get("output_attentions", False))


def _register() -> bool:
    with _REGISTERED:
        if not _DONE:
            try:
                from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
                from transformers.modeling_utils import AttentionInterface
            except ImportError:
                _DONE.append(False)
            else:
                AttentionInterface.register(NAME, folded_sdpa)
                AttentionMaskInterface.register(NAME, sdpa_mask)
                _DONE.append(True)
        return _DONE[0]


def sdpa_model(model) -> bool:
    """Whether ``model`` runs transformers' ``sdpa`` attention (one config, no sub-models)."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == "sdpa" and not getattr(config, "sub_configs", None)


def grouped(model) -> bool:
    """Whether ``model`` runs ``sdpa`` attention with grouped key heads, which the fold serves."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or getattr(config, "sub_configs", None):
        return False
    return any(isinstance(getattr(m, "num_key_value_groups", None), int) and m.num_key_value_groups > 1
               for m in model.modules())


class folding:
    """Within the block, ``model``'s attention is :func:`folded_sdpa` (where :func:`grouped`, or
    where ``store`` is a paged store whose steps attend straight from its pool: then the store's
    layers hand the pool itself to the attention, ``store.direct``, only inside the block).

    The name is written straight into the config's own field, not through its setter: each
    step enters the block, and an assignment through the class would tell graphwrap's watch of
    the module that an attribute changed, which costs a full look at the module (milliseconds
    for a 22-layer model) every step. Every capture of the step runs inside the block, so the
    graphs are captured with the folded attention and the watch sees the same value at every
    step; an implementation the user sets (``set_attn_implementation``) is not ``sdpa``, so
    the block leaves it, and the watch sees the change.

    On a GPU, the model's Llama-form RMSNorms and GPT-2's GELUs also run as one kernel each on
    each thread inside the block (:mod:`.fused`)."""

    def __init__(self, model, store=None):
        config = getattr(model, "config", None)
        p = next(model.parameters(), None)
        # (norms and GELUs in one kernel inside the block on a GPU, see fused.py)
        self.fused = p is not None and p.is_cuda and fused.prepare(model) > 0
        direct = getattr(store, "kernel", False) and sdpa_model(model)
        wanted = (grouped(model) and not sdpa_folds()) or direct
        self.config = config if wanted and _settable(config) and _register() else None
        self.store = store if direct and self.config is not None else None
        self.set = False
        # The decode thread and the thread capturing shapes beside it may be inside at once:
        # the first in sets the attention, the last out puts it back.
        self.lock = threading.Lock()
        self.inside = 0

    def __enter__(self):
        if self.fused:
            fused.enter()
        if self.config is None:
            return self
        with self.lock:
            if self.inside == 0:
                self.set = vars(self.config).get(FIELD) == "sdpa"
                if self.set:
                    object.__setattr__(self.config, FIELD, NAME)
                    if self.store is not None:
                        self.store.direct = True
            self.inside += 1
        return self

    def __exit__(self, *exc):
        if self.fused:
            fused.leave()
        if self.config is None:
            return
        with self.lock:
            self.inside -= 1
            if self.inside:
                return
            if self.store is not None:
                self.store.direct = False
            if self.set and vars(self.config).get(FIELD) == NAME:
                object.__setattr__(self.config, FIELD, "sdpa")


FIELD = "_attn_implementation_internal"  # what transformers' config property reads


class without_cudnn:
    """Within the block, on a GPU, torch's ``scaled_dot_product_attention`` does not pick its
    cuDNN backend; flash and memory-efficient kernels serve instead.

    Where torch prefers cuDNN's attention (Hopper and later, with a recent cuDNN), the first call
    at each new shape builds a cuDNN graph on the host: 40-45 ms on an H200 with torch 2.11
    (the sdpa_shapes.py probe, in graphwrap's history). The shared batch's first burst took 9.4 s with
    it against 2.3 s without (GPT-2, a fresh process), a 7B model's first ``model.generate``
    calls ran at a third of their pace, and each piece of a long prompt (a new key length every
    time) took 87 ms of the decode thread against 32. The batch's eager forwards (pieces, shapes not
    captured yet, the probe, the cache's layout) and its captures meet new shapes all the time,
    as does a call in the one-call loop (its prompt's length); the batch's replays of captured
    graphs are not wrapped, and run whichever kernels their capture chose.

    torch's switch is the process's (``torch.backends.cuda.enable_cudnn_sdp``): the first block
    in turns it off, the last one out puts back what it was, so another thread's attention
    meanwhile runs the same flash or memory-efficient kernels (equal to rounding). A switch the
    user turned off stays off."""

    _lock = threading.Lock()
    _inside = 0
    _was = True

    def __init__(self, device):
        self.on = getattr(device, "type", None) == "cuda"

    def __enter__(self):
        if self.on:
            cls = without_cudnn
            with cls._lock:
                if cls._inside == 0:
                    cls._was = torch.backends.cuda.cudnn_sdp_enabled()
                    torch.backends.cuda.enable_cudnn_sdp(False)
                cls._inside += 1
        return self

    def __exit__(self, *exc):
        if self.on:
            cls = without_cudnn
            with cls._lock:
                cls._inside -= 1
                if cls._inside == 0:
                    torch.backends.cuda.enable_cudnn_sdp(cls._was)


def sdpa_folds() -> bool:
    """Whether this transformers' own sdpa folds a single query position's grouped heads
    (``pack_gqa``, from transformers 5.24): then the model's own attention is used as it is."""
    try:
        from transformers.integrations import sdpa_attention
    except ImportError:
        return False
    return hasattr(sdpa_attention, "pack_gqa")


def _settable(config) -> bool:
    return isinstance(getattr(type(config), "_attn_implementation", None), property) and FIELD in vars(config)
