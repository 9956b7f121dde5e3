"""Int4 weight-only layers through torchao (``graphwrap.quantize(model, "int4")``).

For one stream and small batches a decode step is bound by reading the weights, and int4
weight-only layers read a quarter of fp16's bytes. torchao's ``Int4WeightOnlyConfig``, in groups
of 128 along the input, packed for torch's own int4 kernel (``tile_packed_to_4d``: tinygemm, no
other library), on a CUDA GPU with the model in bfloat16, which that kernel takes; refused
elsewhere, with the reason. Its layers are tensor subclasses whose every step is a device
operation: a graph captures and replays them like any other. (int8 weight-only layers are
graphwrap's own: :class:`~.quantized.Int8Linear`.)

A model quantized with torchao's ``quantize_`` by its owner (int8 or int4) wraps the same way:
nothing here is needed for it. torchao is an optional extra: ``pip install "graphwrap[quant]"``.
"""

import logging
from typing import Iterable

import torch
import torch.nn as nn

from .errors import GraphwrapError

logger = logging.getLogger("graphwrap")
GROUP = 128  # int4: input positions sharing a scale and a zero point


def refused(model: nn.Module, kind: str) -> "str | None":
    """Why ``kind`` (torchao's: int4) cannot be served for ``model`` here (None where it can)."""
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
    """``model``'s ``nn.Linear`` layers but those named in ``skip`` in ``kind`` (int4), in place,
    by torchao's ``quantize_``; raises :class:`GraphwrapError` with the reason where it cannot."""
    why = refused(model, kind)
    if why is not None:
        raise GraphwrapError(f"quantize(..., {kind!r}): {why}")
    skip = set(skip)
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
