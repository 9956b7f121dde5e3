"""Int8 and int4 weight-only layers (``graphwrap.quantize(model, "int8" | "int4")``).

For one stream and small batches a decode step is bound by reading the weights, and weight-only
integers read a half (int8) or a quarter (int4) of fp16's bytes.

- ``"int8"``: graphwrap's own :class:`Int8Linear`: each weight in int8 with a scale per output
  channel (its largest magnitude over 127), the activations as they are. On a GPU with Triton,
  in fp16 or bf16, one kernel of graphwrap's makes the product (``quantized.few_rows``, the FP8
  layers' kernel reading int8 weights): each int8 value is exact in the activations' dtype, the
  products summed in fp32, scaled and rounded once. Elsewhere (a CPU, fp32) the weight scaled
  back to the activations' dtype and torch's product. An attention layer's q, k and v (and an
  MLP's gate and up) share one buffer, as FP8 layers do, so the shared batch makes them as one
  product. No extra needed.
- ``"int4"``: torchao's ``Int4WeightOnlyConfig`` in groups of 128 along the input, packed for
  torch's own int4 kernel (``tile_packed_to_4d``: tinygemm, no other library), on a CUDA GPU with
  the model in bfloat16, which that kernel takes. Refused elsewhere, with the reason. Its layers
  are tensor subclasses whose every step is a device operation: a graph captures and replays
  them like any other.

A model quantized with torchao's ``quantize_`` by its owner (int8 or int4) wraps the same way:
nothing here is needed for it. torchao is an optional extra: ``pip install "graphwrap[quant]"``.
"""

import logging
from typing import Iterable, Set

import torch
import torch.nn as nn
from torch import Tensor

from .errors import GraphwrapError
from .quantized import SHARED, TINY, QuantizedLinear, _linear, _share, _triton, _weight, few_rows

logger = logging.getLogger("graphwrap")
GROUP = 128  # int4: input positions sharing a scale and a zero point
INT8_MAX = 127.0


class Int8Linear(QuantizedLinear):
    """``nn.Linear``'s product from int8 weights: ``weight_int8 [out, in]`` and ``weight_scale
    [1, out]`` (float32, per output channel: the row's largest magnitude over 127), the input as
    it is; the bias, if any, added in the input's dtype."""

    QUANTIZED = "weight_int8"
    KIND = "int8"
    weight_int8: Tensor

    def __init__(self, linear: nn.Module):
        w = _weight(linear).float()
        scale = w.abs().amax(dim=1).clamp(min=TINY) / INT8_MAX
        super().__init__(linear, (w / scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale)

    @staticmethod
    def rows(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        rows = x.reshape(-1, weight.shape[1])
        if (rows.is_cuda and rows.dtype in (torch.float16, torch.bfloat16) and _triton()
                and not torch.compiler.is_compiling()):
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            return few_rows(rows, None, weight, scale, rows.dtype)
        return nn.functional.linear(rows, (weight.to(torch.float32) * scale.t()).to(rows.dtype))


def refused(model: nn.Module, kind: str) -> "str | None":
    """Why ``kind`` cannot be served for ``model`` here (None where it can)."""
    if kind == "int8":
        return None
    try:
        import torchao  # noqa: F401
    except ImportError:
        return f"{kind} weights need torchao: pip install 'graphwrap[quant]'"
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cuda":
        return "int4 weights run on a CUDA GPU only (torch's int4 kernel); this model is on " + (
            str(p.device) if p is not None else "no device")
    if p.dtype != torch.bfloat16:
        return (f"int4 weights need the model in bfloat16 (torch's int4 kernel takes it), not {p.dtype}: "
                "model.bfloat16() (serve: --dtype bfloat16)")
    return None


def quantize(model: nn.Module, kind: str, skip: Iterable[str]) -> nn.Module:
    """``model``'s ``nn.Linear`` layers but those named in ``skip`` in ``kind``, in place, by
    torchao's ``quantize_``; raises :class:`GraphwrapError` with the reason where it cannot."""
    why = refused(model, kind)
    if why is not None:
        raise GraphwrapError(f"quantize(..., {kind!r}): {why}")
    skip = set(skip)
    if kind == "int8":
        return _int8(model, skip)
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    taken = []

    def chosen(module: nn.Module, name: str) -> bool:
        ok = type(module) is nn.Linear and name.rsplit(".", 1)[-1] not in skip
        if ok:
            taken.append(name)
        return ok

    # (set_inductor_config: torchao's default sets Inductor's options for the whole process)
    config = Int4WeightOnlyConfig(group_size=GROUP, int4_packing_format="tile_packed_to_4d", set_inductor_config=False)
    quantize_(model, config, filter_fn=chosen)
    logger.info("quantize %s: %d linear layers by torchao; left as they are by name: %s", kind, len(taken),
                ", ".join(sorted(skip)) or "none")
    if not taken:
        logger.warning("quantize %s: no linear layer of this model could be quantized: it runs as it was", kind)
    return model


def _int8(model: nn.Module, skip: Set[str]) -> nn.Module:
    """``model``'s linear layers (``nn.Linear``, ``Conv1D``) but those named in ``skip`` as
    :class:`Int8Linear`, in place, each group of :data:`~.quantized.SHARED` in one buffer."""
    targets, skipped = [], 0
    for module in model.modules():
        for name, child in module.named_children():
            if _linear(child):
                if name in skip:
                    skipped += 1
                else:
                    targets.append((module, name, child))
    for module, name, child in targets:
        setattr(module, name, Int8Linear(child))
    shared = [sum(n) for n in zip(*(_share(m) for m in model.modules()))] or [0] * len(SHARED)
    logger.info("quantize int8: %d linear layers in int8 weight-only (sharing a buffer: %s); %d left as they are by "
                "name (%s)", len(targets), ", ".join(f"{n} groups of {'/'.join(g)}" for g, n in zip(SHARED, shared)),
                skipped, ", ".join(sorted(skip)) or "none")
    if not targets:
        logger.warning("quantize int8: no linear layer of this model could be quantized: it runs as it was")
    return model
