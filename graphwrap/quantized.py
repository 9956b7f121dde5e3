"""FP8 weights for the graphs: a model's ``nn.Linear`` layers, in place, as :class:`Fp8Linear`.

``graphwrap.quantize(model, "fp8")`` (``nn.Linear`` and transformers' ``Conv1D``) before the wrap (``GraphedModule(graphwrap.quantize(model,
"fp8"))``, ``serve --quantization fp8``): each weight in FP8 E4M3 with a scale per output
channel, each call's activations scaled per token (row), the product ``torch._scaled_mm``'s
(row-wise scales; on a GPU its output in bfloat16, the cutlass kernel's, then the model's
dtype). Every step of it is a device operation, so it is captured and replayed like any other;
the shared batch's fused projections (``decoding/kernels/qkv.py``, ``mlp.py``) take only plain
``nn.Linear`` and leave these to their own call.

Left in their dtype: the output head (``lm_head``, or any module named in ``skip``), and
layers whose sizes are not multiples of 16 (what ``_scaled_mm`` takes). A GPU below compute
capability 8.9 has no FP8 products: refused with the reason. On a CPU, torch's own kernel
runs it (slowly: for tests). A model quantized again is left as it is.
"""

import contextlib
import functools
import logging
import threading
from typing import Dict, Iterable, Optional, Tuple, cast

import torch
import torch.nn as nn
from torch import Tensor

from .errors import GraphwrapError

logger = logging.getLogger("graphwrap")

KINDS = ("fp8", "int8", "int4")  # (int8 and int4: weight-only, through torchao: weight_only.py)
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
TINY = 1e-12  # (a row of zeros: its scale, so that nothing divides by zero)
INV_MAX = float(torch.tensor(1.0) / FP8_MAX)  # (float32's: torch divides by a number on a GPU so)
WIDEST = 32768  # the widest row graphwrap's kernel takes in one program (rows_to_fp8)
_HERE = threading.local()  # exact: this thread's Fp8Linear products unrounded (exact_products)


class Fp8Linear(nn.Module):
    """``nn.Linear``'s product from FP8: ``weight_fp8 [out, in]`` (E4M3) and ``weight_scale
    [1, out]`` (float32, per output channel) made from the layer's weight; the input's rows
    scaled to E4M3 each call by their largest magnitude; the bias, if any, added in the input's
    dtype."""

    weight_fp8: Tensor
    weight_scale: Tensor

    def __init__(self, linear: nn.Module):
        super().__init__()
        w = _weight(linear)
        self.out_features, self.in_features = w.shape
        scale = w.float().abs().amax(dim=1).clamp(min=TINY) / FP8_MAX
        self.register_buffer("weight_fp8", (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8))
        self.register_buffer("weight_scale", scale[None, :].contiguous())
        bias = cast(Optional[Tensor], linear.bias)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.train(linear.training)  # (an eval model's layer stays in eval: a training one runs eagerly)

    def forward(self, x: Tensor) -> Tensor:
        if getattr(_HERE, "exact", False):  # (see exact_products)
            w = (self.weight_fp8.float() * self.weight_scale.t()).to(x.dtype)
            return nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
        rows = x.reshape(-1, self.in_features)
        q, scale = rows_to_fp8(rows)
        # (row-wise scales on a GPU: the cutlass kernel writes bfloat16 only)
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        out = torch._scaled_mm(q, self.weight_fp8.t(), scale_a=scale, scale_b=self.weight_scale,
                               out_dtype=out_dtype).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8"


@contextlib.contextmanager
def exact_products():
    """On this thread, each :class:`Fp8Linear` multiplies by its FP8 weight in the input's dtype,
    the input not rounded to FP8. For checks that compare two ways of running one model (the
    shared batch's check of a model, ``decoding/engine/probe.py``): each call's activations are
    rounded to FP8 row by row, so a difference at the rounding level of either way's attention
    moves some of them a whole FP8 step, and on random weights the logits came 7-10% of their
    scale apart (a 1.1B and an 8B Llama shape), past the check's 5%, though the two ways attend
    alike. The products are the same module calls either way, row by row, so what is checked
    (positions, masks, the cache) is checked as well without the rounding."""
    before = getattr(_HERE, "exact", False)
    _HERE.exact = True
    try:
        yield
    finally:
        _HERE.exact = before


def rows_to_fp8(rows: Tensor) -> Tuple[Tensor, Tensor]:
    """``rows [n, k]`` in E4M3 and their scales ``[n, 1]`` (float32): each row divided by its
    largest magnitude over 448. On a GPU with Triton one kernel of graphwrap's does it (where
    the rows fit one program), else the torch steps of :func:`rows_to_fp8_reference`: five
    kernels a layer, which at batch 1 cost more than the product (about 2-3 us each in a graph
    against the layer's few)."""
    k = rows.shape[1]
    if not (rows.is_cuda and k <= WIDEST and _triton() and not torch.compiler.is_compiling()):
        return rows_to_fp8_reference(rows)
    from ._fp8_triton import rows_to_fp8 as kernel

    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    q = torch.empty(rows.shape, dtype=FP8, device=rows.device)
    scale = torch.empty((rows.shape[0], 1), dtype=torch.float32, device=rows.device)
    if rows.shape[0]:
        block = 1 << max(4, (k - 1).bit_length())
        kernel[(rows.shape[0],)](rows, q, scale, rows.stride(0), q.stride(0), k, FP8_MAX=FP8_MAX, INV_MAX=INV_MAX, TINY=TINY,
                                 BLOCK=block, num_warps=max(1, min(8, block // 512)))
    return q, scale


def rows_to_fp8_reference(rows: Tensor) -> Tuple[Tensor, Tensor]:
    """What :func:`rows_to_fp8` computes, in torch steps."""
    scale = rows.float().abs().amax(dim=1, keepdim=True).clamp(min=TINY) / FP8_MAX
    return (rows.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@functools.lru_cache(maxsize=None)
def _triton() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def _weight(layer: nn.Module) -> Tensor:
    """A linear layer's weight as ``[out, in]`` (transformers' ``Conv1D``, GPT-2's, holds it
    ``[in, out]``)."""
    w = cast(Tensor, layer.weight).detach()
    return w.t() if _conv1d(layer) else w


def _conv1d(layer: nn.Module) -> bool:
    return type(layer).__name__ == "Conv1D" and hasattr(layer, "nf") and cast(Tensor, layer.weight).dim() == 2


def _linear(layer: nn.Module) -> bool:
    return type(layer) is nn.Linear or _conv1d(layer)


@functools.lru_cache(maxsize=None)
def _cpu_product() -> Optional[str]:
    """Why this torch has no FP8 product on a CPU (None where a small one runs)."""
    try:
        one = torch.ones((16, 16), dtype=FP8)
        torch._scaled_mm(one, one.t(), scale_a=torch.ones((16, 1)), scale_b=torch.ones((1, 16)),
                         out_dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - older torch builds: said, not raised
        return f"this torch ({torch.__version__}) has no FP8 product on a CPU ({type(e).__name__}: {e})"
    return None


def fp8_supported(device: torch.device) -> Optional[str]:
    """Why ``device`` cannot run FP8 products (None where it can)."""
    if device.type == "cpu":
        return _cpu_product()
    if device.type != "cuda":
        return f"FP8 products are served on CUDA GPUs (and, slowly, on CPUs), not on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"FP8 products need compute capability 8.9 or later (Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} has {major}.{minor}")
    return None


def quantize(model: nn.Module, kind: str = "fp8", skip: Iterable[str] = ("lm_head",)) -> nn.Module:
    """``model`` with its linear layers (``nn.Linear``, ``Conv1D``) in ``kind``, in place, returned:
    ``"fp8"`` (here), or ``"int8"`` and ``"int4"`` weight-only (``nn.Linear``, through torchao:
    :mod:`.weight_only`). The modules named (last part of the name) in ``skip`` are left as they
    are, and in FP8 layers of sizes not multiples of 16. The log says how many were quantized."""
    if kind not in KINDS:
        raise GraphwrapError(f"quantize: kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    if kind != "fp8":
        from . import weight_only

        return weight_only.quantize(model, kind, skip)
    skip = set(skip)
    counts: Dict[str, int] = {"quantized": 0, "skipped": 0, "sizes": 0}
    targets = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if not _linear(child):
                continue
            if child_name in skip:
                counts["skipped"] += 1
            elif any(n % 16 for n in child.weight.shape):
                counts["sizes"] += 1
            else:
                targets.append((module, child_name, child))
    for _, _, child in targets[:1]:
        why = fp8_supported(child.weight.device)
        if why is not None:
            raise GraphwrapError(f"quantize(..., {kind!r}): {why}")
    for module, child_name, child in targets:
        setattr(module, child_name, Fp8Linear(child))
        counts["quantized"] += 1
    if not counts["quantized"]:
        logger.warning("quantize %s: no linear layer of this model could be quantized (%d by name, %d by size): it "
                       "runs as it was", kind, counts["skipped"], counts["sizes"])
    logger.info("quantize %s: %d linear layers in FP8; %d left as they are by name (%s), %d whose sizes are not "
                "multiples of 16", kind, counts["quantized"], counts["skipped"], ", ".join(sorted(skip)) or "none",
                counts["sizes"])
    return model
