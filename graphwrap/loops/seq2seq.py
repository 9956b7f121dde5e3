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
it): one per batch size, self-attention length (a multiple of 64) and encoder length.

Encoder lengths go in buckets: where ``generate`` hands the decoder an encoder mask (text:
T5, BART, ...), the encoder's output and that mask are padded with zeros to the next multiple
of 64 positions (:func:`pad_encoded`), so requests of every length in a bucket share one cache
and one set of graphs; the padded positions are masked, as the tokenizer's own padding is. A
model that does not honour that mask would read them: so the first request that pads asks the
model's preparation whether it passes the mask on and runs the decoder's first step on both
(once per GraphedModule), and pads only where it does and the logits agree.
Without a mask (Whisper: always 1500 frames) each length keeps its own cache. After ``max_keys``
caches, further lengths keep ``generate``'s cache (and run eagerly once the engine's
``max_keys`` signatures are taken).
"""

import logging
from typing import Optional

import torch

from ..core.state import cache_parts

logger = logging.getLogger("graphwrap")
BUCKET = 64  # encoder positions are padded to a multiple of this

# What an encoder-decoder's decode step may take for its inputs to be kept from step to step.
LEAN_KEYS = frozenset(("decoder_input_ids", "past_key_values", "cache", "attention_mask", "encoder_outputs",
                       "use_cache", "decoder_attention_mask"))


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
    causal mask hides those slots anyway), its new column set each step on the device. From
    transformers 5.24 the preparation passes a mask of its own, a 4D one over the whole cache
    for the new token's row (built on the host each step): the loop keeps that one and sets its
    new column each step, as the preparation would."""

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
        given = inputs.get("decoder_attention_mask")
        if given is not None:  # the preparation's own: kept where it is a row over the whole cache
            if (whole is None or length > whole or not isinstance(given, torch.Tensor) or given.dtype != torch.bool
                    or tuple(given.shape) != (ids.shape[0], 1, 1, whole)):
                return None
            return cls(lean, given, length - 1)
        if whole is not None and length <= whole and _takes(model, "decoder_attention_mask"):
            mask = torch.zeros(ids.shape[0], whole, dtype=torch.long, device=ids.device)
            mask[:, :length] = 1
            lean["decoder_attention_mask"] = mask
        return cls(lean, mask, length - 1)

    def next(self, tokens: torch.Tensor) -> dict:
        self.inputs["decoder_input_ids"] = tokens[:, None]
        if self.mask is not None:
            self.column += 1
            self.mask[..., self.column] = 1
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


def own_cache(held: dict, model, input_ids, model_kwargs: dict, max_keys: int) -> bool:
    """Put a static encoder-decoder cache of graphwrap's own (``held["_gw_caches"]``, reset)
    in place of the fresh one ``generate`` made, the encoder's output padded to its length
    bucket where the model allows (:func:`pad_encoded`); whether it did."""
    found = _cache_key(model, model_kwargs)
    encoded = model_kwargs.get("encoder_outputs")
    hidden = encoded[0] if encoded is not None and len(encoded) else None
    if found is None or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        return False
    padded = pad_encoded(held, model, input_ids, model_kwargs)
    if padded is not None:
        hidden = padded[0][0]
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
    if padded is not None:
        model_kwargs["encoder_outputs"], model_kwargs["attention_mask"] = padded
    return True


def pad_encoded(held: dict, model, input_ids, model_kwargs: dict) -> Optional[tuple]:
    """``(encoder output, mask)`` of ``model_kwargs`` padded with zeros to the next multiple of
    :data:`BUCKET` positions, where there is a mask of the output's length and the model's
    decoder honours it (``held["_gw_pads"]``: found on the first request that pads); else None."""
    encoded, mask = model_kwargs.get("encoder_outputs"), model_kwargs.get("attention_mask")
    if encoded is None:
        return None
    hidden = encoded[0]
    if (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != tuple(hidden.shape[:2])
            or held.get("_gw_pads") is False):
        return None
    length = hidden.shape[1]
    size = -(-length // BUCKET) * BUCKET
    if size == length:
        return None
    padded = _with_hidden(encoded, torch.cat([hidden, hidden.new_zeros(hidden.shape[0], size - length,
                                                                        hidden.shape[2])], dim=1))
    if padded is None:
        return None
    padded_mask = torch.cat([mask, mask.new_zeros(mask.shape[0], size - length)], dim=1)
    if "_gw_pads" not in held:
        held["_gw_pads"] = (_preparation_passes_mask(model, input_ids, model_kwargs, padded, padded_mask)
                            and _decoder_honours_mask(model, input_ids, encoded, mask, padded, padded_mask))
        if not held["_gw_pads"]:
            return None
    return padded, padded_mask


def _with_hidden(encoded, hidden: torch.Tensor):
    """The encoder's output with ``hidden`` for its last hidden state (None where it cannot be told)."""
    if isinstance(encoded, dict):  # a ModelOutput
        if "last_hidden_state" not in encoded:
            return None
        return type(encoded)(**{**encoded, "last_hidden_state": hidden})
    if isinstance(encoded, tuple):
        return (hidden,) + tuple(encoded[1:])
    return None


def _preparation_passes_mask(model, input_ids, model_kwargs: dict, padded, padded_mask) -> bool:
    """Whether the model's ``prepare_inputs_for_generation`` hands the (padded) encoder mask on to
    its forward, as transformers' own does (an override could leave it out: the forward would
    then read the padded positions)."""
    try:
        prepared = model.prepare_inputs_for_generation(
            input_ids, **{**model_kwargs, "encoder_outputs": padded, "attention_mask": padded_mask})
        got = prepared.get("attention_mask")
        ok = isinstance(got, torch.Tensor) and got.shape[-1] == padded_mask.shape[-1]
        why = "its prepare_inputs_for_generation does not pass the encoder's mask on"
    except Exception as e:  # noqa: BLE001 - a preparation that cannot be asked keeps one cache per length
        ok, why = False, f"its prepare_inputs_for_generation failed on a padded output ({type(e).__name__}: {e})"
    if not ok:
        logger.info("%s's encoder output is not padded to length buckets (%s): one cache and graphs "
                    "per encoder length, at most max_keys", type(model).__name__, why)
    return ok


def _decoder_honours_mask(model, input_ids, encoded, mask, padded, padded_mask) -> bool:
    """The decoder's first step on the encoder's output and on it padded (use_cache off): whether
    the logits agree, so that the padded positions are masked out."""
    try:
        with torch.no_grad():
            plain = model(decoder_input_ids=input_ids, encoder_outputs=encoded, attention_mask=mask,
                          use_cache=False, return_dict=True).logits.float()
            pad = model(decoder_input_ids=input_ids, encoder_outputs=padded, attention_mask=padded_mask,
                        use_cache=False, return_dict=True).logits.float()
        tol = 1e-4 if getattr(model, "dtype", None) == torch.float32 else 1e-2
        ok = bool((pad - plain).abs().max() <= tol * max(float(plain.abs().max()), 1.0))
        why = "its logits differ with the padded positions masked"
    except Exception as e:  # noqa: BLE001 - a decoder that cannot be run so keeps one cache per length
        ok, why = False, f"its first step on a padded output failed ({type(e).__name__}: {e})"
    if not ok:
        logger.info("%s's encoder output is not padded to length buckets (%s): one cache and graphs "
                    "per encoder length, at most max_keys", type(model).__name__, why)
    return ok
