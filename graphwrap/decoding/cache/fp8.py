"""The shared batch's cache in FP8: ``decode={"kv_cache_dtype": "fp8"}``.

Each layer's keys and values are kept in FP8 E4M3 (one byte a value, half of fp16's), each
layer with a scale for its keys and one for its values: a key is stored as the key over its
layer's scale, held within E4M3's range (+-448, saturated: never NaN) and rounded to nearest;
read back, it is multiplied by the scale again. The pool holds twice the positions of fp16's in
the same memory, and a step's attention reads half the bytes.

The scales are set once, when the batch is made, from one eager forward of a fixed prompt
(:data:`CALIBRATION` tokens spread over the vocabulary) through the model's own cache: each
layer's scale puts :data:`HEADROOM` times the largest key (value) seen there at E4M3's largest
value. A key past that is saturated. A prompt's forward attends over its own keys as the model
made them; every forward after it reads them from the pool, as stored.

Plain torch here (the format, the scales, the torch form of a write and a read); graphwrap's
kernels take the same scales (:mod:`..kernels.step_write`, :mod:`..kernels.paged_attention`,
:mod:`..kernels.piece_attention`).
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ..kernels import step_write

Tensor = torch.Tensor
FORMAT = torch.float8_e4m3fn
LARGEST = step_write.FP8_LARGEST  # E4M3's largest finite value
HEADROOM = 2.0  # how far past the calibration's largest key a key is still held unsaturated
CALIBRATION = 256  # tokens of the calibration forward (at most the batch's max_len)


@dataclass(frozen=True)
class Scales:
    """One layer's scales: a stored key is ``key / keys``, a stored value ``value / values``."""

    keys: float
    values: float


def wanted(name: Optional[str]) -> bool:
    """Whether ``decode={"kv_cache_dtype": name}`` asks for FP8 (None and "auto": the model's dtype)."""
    return name in ("fp8", "fp8_e4m3")


def scales_for(key_max: Sequence[float], value_max: Sequence[float]) -> List[Scales]:
    """Each layer's scales from the largest magnitude of its keys and values in the calibration
    forward (a layer that wrote only zeros gets scale 1)."""
    return [Scales(_scale(k), _scale(v)) for k, v in zip(key_max, value_max)]


def _scale(largest: float) -> float:
    largest = float(largest)
    if not largest > 0 or largest != largest or largest == float("inf"):
        return 1.0
    return HEADROOM * largest / LARGEST


def calibration_ids(vocab: int, n: int) -> List[int]:
    """The calibration prompt: ``n`` token ids spread over ``[1, vocab)`` (a fixed stride)."""
    top = max(int(vocab) - 1, 1)
    return [1 + (i * 7919) % top for i in range(n)]


def encode(x: Tensor, scale: float) -> Tensor:
    """``x`` as stored: times one over ``scale`` (in fp32, as the kernels do), saturated at
    +-:data:`LARGEST`, rounded to E4M3."""
    return step_write.scaled(x, scale).to(FORMAT)


def decode(x: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """Stored ``x`` read back in ``dtype`` (a value of the model's dtype: unchanged)."""
    if x.dtype != FORMAT:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def round_trip(x: Tensor, scale: float) -> Tensor:
    """What ``x`` reads back as, once stored (in its own dtype): for references."""
    return decode(encode(x, scale), scale, x.dtype)


def kernels_read(device: torch.device) -> bool:
    """Whether graphwrap's Triton kernels can read and write E4M3 on ``device`` (compute
    capability 8.9 and later); elsewhere the pool's blocks are gathered and read back in torch."""
    return step_write.writes_e4m3(torch.device(device))


def describe(scales: Optional[List[Scales]]) -> Optional[dict]:
    """What ``stats()["decode"]["kv_cache"]`` says of the scales (None: the model's dtype)."""
    if scales is None:
        return None
    ks = [s.keys for s in scales]
    vs = [s.values for s in scales]
    return {"dtype": "fp8_e4m3", "layers": len(scales), "key_scale": [min(ks), max(ks)],
            "value_scale": [min(vs), max(vs)], "headroom": HEADROOM}
