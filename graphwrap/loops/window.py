"""Sliding-window attention in the one-call decode loop: a cache whose position lives on the
device, and masks the loop keeps.

transformers' static sliding-window layer keeps its position twice: as a tensor, and as a
Python int that picks its branch (fill, or roll the window once full) and the offset of every
step's mask. A graph replays that int frozen, so graphwrap refuses to capture it and such
models (Mistral, Gemma 2 and 3, Cohere 2, ...) decoded eagerly.

:func:`ring_layer` replaces those layers in graphwrap's own cache. Its window is a ring: the
token at position ``p`` is written to slot ``p % W`` at the position the device holds, so a
decode step is the same work every step, with no Python number that moves. Attention does not
care where a key sits as long as the mask says which slots it may read, so the loop builds the
masks itself (:class:`RingMasks`): one row of slots per sequence, a slot readable where the
position it holds is a real token of that row; the model is given them as they are (a 4-D mask,
or one per layer type), and moving them on by a token is one write per step.

A ring only serves with those masks. Anywhere else (the prompt's forward, a step without them)
:meth:`update` returns the window in position order and :meth:`get_mask_sizes` gives
transformers' own sizes, read from the device: correct, and run eagerly.
"""

import inspect
import re
from typing import Any, Callable, List, Optional, Union

import torch

from ..errors import GraphwrapError

SLIDING, FULL = "sliding_attention", "full_attention"
ATTENTION = ("sdpa", "eager")  # the masks the loop builds: boolean for sdpa, additive for eager
_CLASS: List[type] = []  # RingLayer, made once


def ring_layer(max_cache_len: int, sliding_window: int):
    """A new ring layer (the class is made from this transformers' ``StaticLayer`` once)."""
    if not _CLASS:
        from transformers.cache_utils import StaticLayer
        body = {k: v for k, v in vars(_Ring).items() if k not in ("__dict__", "__weakref__", "__annotations__")}
        _CLASS.append(type("RingLayer", (StaticLayer,), body))
    return _CLASS[0](max_cache_len=max_cache_len, sliding_window=sliding_window)


def _static(layer) -> Any:
    """``super()`` of a ring layer: transformers' ``StaticLayer``."""
    return super(_CLASS[0], layer)


class _Ring:
    """The methods of a ring layer (on top of transformers' ``StaticLayer``, which allocates the
    ``[batch, heads, W, dim]`` keys and values and keeps ``cumulative_length`` on the device)."""

    is_sliding = True
    # What StaticLayer provides (declared for the type checker; the class made above has them).
    keys: torch.Tensor
    values: torch.Tensor
    cumulative_length: torch.Tensor
    is_initialized: bool
    max_cache_len: int
    lazy_initialization: Callable[..., None]

    def __init__(self, max_cache_len: int, sliding_window: int, **kwargs):
        _static(self).__init__(max_cache_len=min(max_cache_len, sliding_window))
        self.window = self.max_cache_len
        self.ring_masks = False  # True while the loop gives the model graphwrap's masks

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, w = key_states.shape[-2], self.window
        if n == 1 and self.ring_masks:  # a decode step: the same work every step, position on the device
            slot = torch.remainder(self.cumulative_length, w).reshape(1)
            self.keys.index_copy_(2, slot, key_states)
            self.values.index_copy_(2, slot, value_states)
            self.cumulative_length.add_(1)
            return self.keys, self.values
        return self._in_order(key_states, value_states)

    def _in_order(self, key_states, value_states):
        """transformers' sliding-window update, over the ring put in position order (eager: it
        reads the position on the host)."""
        n, w = key_states.shape[-2], self.window
        start = int(self.cumulative_length)
        order = torch.remainder(torch.arange(w, device=self.keys.device) + start, w) if start >= w else None
        keys = self.keys if order is None else self.keys.index_select(2, order)  # oldest first
        values = self.values if order is None else self.values.index_select(2, order)
        if start >= w:
            full_k, full_v = torch.cat((keys[:, :, 1:], key_states), -2), torch.cat((values[:, :, 1:], value_states), -2)
        elif start + n > w:
            full_k, full_v = torch.cat((keys[:, :, :start], key_states), -2), torch.cat((values[:, :, :start], value_states), -2)
        else:  # still filling: slots are positions
            pos = torch.arange(start, start + n, device=self.keys.device)
            self.keys.index_copy_(2, pos, key_states)
            self.values.index_copy_(2, pos, value_states)
            self.cumulative_length.add_(n)
            return self.keys, self.values
        end = start + n  # the last w positions go to their slots
        slots = torch.remainder(torch.arange(end - w, end, device=self.keys.device), w)
        self.keys.index_copy_(2, slots, full_k[:, :, -w:])
        self.values.index_copy_(2, slots, full_v[:, :, -w:])
        self.cumulative_length.add_(n)
        return full_k, full_v

    def get_mask_sizes(self, query_length: int, *args) -> tuple:
        """transformers' sizes for a window in position order (what :meth:`update` returns
        without the loop's masks)."""
        start, w = int(self.cumulative_length), self.window
        offset = max(start - w + 1, 0)
        if start >= w:
            return w + query_length - 1, offset
        if start + query_length > w:
            return start + query_length, offset
        return w, offset

    def get_seq_length(self) -> Union[int, torch.Tensor]:
        # The position as a tensor on the device: transformers adds to it without a host read.
        return self.cumulative_length if self.is_initialized else 0

    def reset(self):
        _static(self).reset()
        self.ring_masks = False


def is_ring(layer) -> bool:
    return bool(_CLASS) and isinstance(layer, _CLASS[0])


def ring_unsupported(model) -> Optional[str]:
    """Why graphwrap's loop cannot serve this model's sliding windows with a ring (None when it
    can, or when it has none)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    types = layer_types(config)
    if SLIDING not in types:
        return None
    if getattr(config, "_attn_implementation", None) not in ATTENTION:
        return f"its attention is {config._attn_implementation!r} (a sliding window is served for sdpa and eager)"
    if set(types) - {SLIDING, FULL}:
        return f"its layers are of kinds {sorted(set(types))} (a window is served beside full attention only)"
    if FULL in types and not _takes_mask_per_type(model):
        return "its forward takes no mask per layer type"
    return None


def layer_types(config) -> list:
    """The cache's layer kinds, as transformers' static cache reads them from the config."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:
        return []
    return list(get_layer_types_and_kwargs(config)[0])


_MASK_MAPPING = re.compile(r"isinstance\(\s*(\w+\s*:=\s*)?attention_mask\s*,\s*dict\s*\)")


def _takes_mask_per_type(model) -> bool:
    """Whether the model's decoder takes ``attention_mask`` as a dict of masks by layer type."""
    base = getattr(model, "base_model", model)
    for cls in type(base).__mro__:
        forward = vars(cls).get("forward")
        if forward is not None:
            try:
                return bool(_MASK_MAPPING.search(inspect.getsource(forward)))
            except (OSError, TypeError):
                return False
    return False


def use_rings(cache, config, length: int) -> bool:
    """Put ring layers in place of the sliding-window layers of ``cache`` (a new transformers
    ``StaticCache`` of ``length`` positions, not allocated yet); whether it has any."""
    done = False
    for i, kind in enumerate(layer_types(config)[:len(cache.layers)]):
        if kind == SLIDING:
            if getattr(cache.layers[i], "is_initialized", False):
                raise GraphwrapError("internal: ring layers replace a cache's layers before it is allocated")
            cache.layers[i] = ring_layer(length, config.sliding_window)
            done = True
    return done


class RingMasks:
    """The masks of a decode step over a cache with ring layers, kept by the loop: one per
    layer kind (``[rows, 1, 1, length]``), moved on by one token per step."""

    def __init__(self, cache, mask2d: torch.Tensor, dtype: torch.dtype, attention: str, per_type: bool):
        rings = [layer for layer in cache.layers if is_ring(layer)]
        fulls = [layer for layer in cache.layers if not is_ring(layer)]
        self.rings = rings
        self.q = mask2d.shape[1] - 1  # the position of the token the next step reads
        real = mask2d.to(torch.bool)
        w = rings[0].window
        window = torch.zeros(real.shape[0], 1, 1, w, dtype=torch.bool, device=real.device)
        first = max(self.q - w + 1, 0)
        slots = torch.remainder(torch.arange(first, self.q + 1, device=real.device), w)
        window[:, 0, 0].index_copy_(1, slots, real[:, first:self.q + 1])
        # In the model's format: boolean for sdpa, 0 or the dtype's lowest for eager attention.
        self.on = True if attention != "eager" else 0.0
        self.window = self._as_model(window, attention, dtype)
        self.full = None
        if fulls:
            full = torch.zeros(real.shape[0], 1, 1, fulls[0].max_cache_len, dtype=torch.bool, device=real.device)
            full[:, 0, 0, :self.q + 1] = real
            self.full = self._as_model(full, attention, dtype)
        self.per_type = per_type

    @staticmethod
    def _as_model(mask: torch.Tensor, attention: str, dtype: torch.dtype) -> torch.Tensor:
        if attention != "eager":
            return mask
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)

    def step(self) -> None:
        """Move on by one token: the next token's slot (and position) becomes readable."""
        self.q += 1
        self.window[..., self.q % self.window.shape[-1]] = self.on
        if self.full is not None:
            self.full[..., self.q] = self.on

    def inputs(self):
        """The attention_mask the model is given this step."""
        return {SLIDING: self.window, FULL: self.full} if self.per_type else self.window
