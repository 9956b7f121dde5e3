"""Encoder-decoders in graphwrap's decode loop (T5, BART, Marian, Whisper, ...).

``generate`` runs the encoder once per request, as it always does, and hands the loop the
decoder's start tokens, the encoder's output and a cache of two parts: self-attention over the
tokens decoded so far, and cross-attention over the encoder's output. The prompt's forward
writes the cross-attention cache; every step after it only reads it (the cache's
``is_updated`` flags, which graphwrap watches, say so). Each step then takes the same inputs as
the one before but its new tokens: the decoder's positions come from the self-attention cache's
counter, on the device.

So that later requests replay the graphs the first one captured, the loop puts a cache of
graphwrap's own in place of the static one ``generate`` made (before anything is written to
it): one per batch size, self-attention length (a multiple of 64) and encoder length. A
request of an encoder length not seen before gets its own cache and graphs (Whisper's is
always the same, 1500 frames); after ``max_keys`` of them, further lengths keep
``generate``'s cache (and run eagerly once the engine's ``max_keys`` signatures are taken).
"""

from typing import Optional

import torch

from ..core.state import cache_parts

# What an encoder-decoder's decode step may take for its inputs to be kept from step to step.
LEAN_KEYS = frozenset(("decoder_input_ids", "past_key_values", "cache", "attention_mask", "encoder_outputs",
                       "use_cache"))


def is_seq2seq(model) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


class LeanSteps:
    """The first decode step's inputs, kept for every step: only ``decoder_input_ids`` changes,
    and where the loop adds it, one column of the decoder's mask. :meth:`make` gives None where
    the model's own preparation must run each step (a decoder mask or positions it passes, or
    inputs the loop does not know).

    Without a decoder mask, BART's decoder (and the many built like it) makes one of ones from
    the length its cache holds, read back from the device: a capture refuses that read. Where
    the forward takes ``decoder_attention_mask`` and the self-attention cache is static, the
    loop passes one over the whole cache instead: ones up to the new token, zeros after (the
    causal mask hides those slots anyway), its new column set each step on the device."""

    def __init__(self, inputs: dict, mask: Optional[torch.Tensor], column: int):
        self.inputs, self.mask, self.column = inputs, mask, column

    @classmethod
    def make(cls, model, inputs: dict, length: int) -> Optional["LeanSteps"]:
        """``length``: the decoder's tokens so far, the new one included."""
        ids = inputs.get("decoder_input_ids")
        if not set(inputs) <= LEAN_KEYS or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[-1] != 1:
            return None
        lean, mask = dict(inputs), None
        whole = _static_length(inputs)
        if whole is not None and length <= whole and _takes(model, "decoder_attention_mask"):
            mask = torch.zeros(ids.shape[0], whole, dtype=torch.long, device=ids.device)
            mask[:, :length] = 1
            lean["decoder_attention_mask"] = mask
        return cls(lean, mask, length - 1)

    def next(self, tokens: torch.Tensor) -> dict:
        self.inputs["decoder_input_ids"] = tokens[:, None]
        if self.mask is not None:
            self.column += 1
            self.mask[:, self.column] = 1
        return self.inputs


def _static_length(inputs: dict) -> Optional[int]:
    cache = inputs.get("past_key_values", inputs.get("cache"))
    parts = cache_parts(cache) if cache is not None else None
    own = parts[0] if parts is not None else None
    if own is None or getattr(own, "is_compileable", False) is not True:
        return None
    try:
        length = own.get_max_length()
    except Exception:  # noqa: BLE001 - a cache whose length cannot be told gets no mask of the loop's
        return None
    return length if isinstance(length, int) and length > 0 else None


def _takes(model, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _cache_key(model, model_kwargs: dict):
    """``(keyword, generate's cache)`` where it is a static encoder-decoder cache ``generate``
    made for this call (fresh, or before transformers 5.17 the one it keeps on the model and
    reset), which the loop may replace; else None (a cache the caller passed)."""
    try:
        from transformers import StaticCache
    except ImportError:
        return None
    for name in ("cache", "past_key_values"):
        cache = model_kwargs.get(name)
        parts = cache_parts(cache) if cache is not None else None
        if parts is None:
            continue
        if not all(type(p) is StaticCache for p in parts):
            return None
        kept = cache is model.__dict__.get("_cache")
        if not kept and any(getattr(layer, "is_initialized", True) for p in parts for layer in p.layers):
            return None  # written already: a cache the caller passed
        return name, cache
    return None


def own_cache(held: dict, model, model_kwargs: dict, max_keys: int) -> bool:
    """Put a static encoder-decoder cache of graphwrap's own (``held["_gw_caches"]``, reset)
    in place of the fresh one ``generate`` made; whether it did."""
    found = _cache_key(model, model_kwargs)
    encoded = model_kwargs.get("encoder_outputs")
    hidden = encoded[0] if encoded is not None and len(encoded) else None
    if found is None or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        return False
    name, given = found
    from transformers import EncoderDecoderCache, StaticCache

    rows, length = hidden.shape[0], hidden.shape[1]
    size = -(-given.self_attention_cache.get_max_length() // 64) * 64
    key = ("seq2seq", rows, size, length, hidden.device, getattr(model, "dtype", None))
    caches = held.setdefault("_gw_caches", {})
    cache = caches.get(key)
    if cache is None:
        if sum(1 for k in caches if k[0] == "seq2seq") >= max_keys:
            return False
        config = model.config.get_text_config(decoder=True)
        cache = caches[key] = EncoderDecoderCache(StaticCache(config=config, max_cache_len=size),
                                                  StaticCache(config=config, max_cache_len=length))
    else:
        cache.reset()
    model_kwargs[name] = cache
    return True
