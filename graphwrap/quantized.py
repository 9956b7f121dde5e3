"""FP8, int8 and int4 weights for the graphs: a model's ``nn.Linear`` layers, in place, as
:class:`Fp8Linear`, :class:`Int8Linear` or :class:`Int4Linear`.

``graphwrap.quantize(model, "fp8")`` (``nn.Linear`` and transformers' ``Conv1D``) before the wrap (``GraphedModule(graphwrap.quantize(model,
"fp8"))``, ``serve --quantization fp8``): each weight in FP8 E4M3 with a scale per output
channel, each call's activations scaled per token (row), the product ``torch._scaled_mm``'s
(row-wise scales, with the tensor cores' fast accumulation on a GPU; its output in the model's
dtype where this torch writes it, else in bfloat16, then cast: :func:`_writes`). Every step of
it is a device operation, so it is captured and replayed like any other.

An attention layer's query, key and value projections (:data:`SHARED`) keep their FP8 weights
and scales in one buffer each, the three layers' views of it, so that the shared batch's forwards
(``decoding/kernels/fused.py``) scale the input once and make the three products as one
(:func:`together`): on an H200 at 256 rows of the Llama-3-8B shape, 14 us a layer against 40 for
the three apart. A device move copies each layer's view alone, so moved layers make their own
products (``quantize`` again lays them out anew); a deep copy keeps the sharing. A gated MLP's
gate and up projections share a buffer likewise: :func:`gated` scales the input once, makes
their two products as one, and SiLU, their product and the down projection's row scaling are
one kernel.

``graphwrap.quantize(model, "int8")``: each weight in int8 with a scale per output channel (its
largest magnitude over 127) as :class:`Int8Linear`, the activations as they are: on a GPU with
Triton, in fp16 or bf16, :func:`few_rows` reads the int8 weights (each made fp16 by its bits);
elsewhere the weight scaled back and torch's product. Its groups share buffers as FP8's do.
``graphwrap.quantize(model, "int4")``: :class:`Int4Linear`, each weight a value 0-15 in
groups of 128 inputs with a scale and an offset each (:mod:`.weight_only` packs them and makes
the product), the activations as they are; its groups share buffers too.

Left in their dtype: the output head (``lm_head``, or any module named in ``skip``), FP8
layers whose sizes are not multiples of 16 (what ``_scaled_mm`` takes), and int4 layers whose
inputs are not a multiple of 128. A GPU below compute
capability 8.9 has no FP8 products: refused with the reason. On a CPU, torch's own kernel
runs it (slowly: for tests). A model quantized again is left as it is.
"""

import contextlib
import functools
import logging
import threading
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple, cast

import torch
import torch.nn as nn
from torch import Tensor

from . import _compat, weight_only
from .errors import GraphwrapError

logger = logging.getLogger("graphwrap")

KINDS = ("fp8", "int8", "int4")  # (int8 and int4: weight-only; int4's packing and product in weight_only.py)
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
TINY = 1e-12  # (a row of zeros: its scale, so that nothing divides by zero)
INT8_MAX = 127.0
INV_MAX = float(torch.tensor(1.0) / FP8_MAX)  # (float32's: torch divides by a number on a GPU so)
WIDEST = 32768  # the widest row graphwrap's kernel takes in one program (rows_to_fp8)
SHARED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # sibling layers of one input whose weights share a buffer (together, gated)
FEEDS = (("input_layernorm", "self_attn", "q_proj"), ("post_attention_layernorm", "mlp", "gate_proj"))  # a norm,
# the sibling module its output goes to, and that one's first FP8 layer (normed: the norm scales its rows)
NORMED = "_gw_fp8_rows"  # a norm module's attribute: its output goes to FP8 layers (quantize sets it; normed)
FAST_ACCUM = True  # the tensor cores' fast FP8 accumulation on a GPU (as torchao's inference products)
ROWS = 16  # at most this many rows take graphwrap's kernel on a GPU (few_rows); more, torch._scaled_mm
# or graphwrap's E4M3 tiles (fp8_tile_shape)
_HERE = threading.local()  # exact: this thread's Fp8Linear products unrounded (exact_products)


class QuantizedLinear(nn.Module):
    """What graphwrap's quantized linear layers share: the weight in an integer or FP8 buffer
    named :attr:`QUANTIZED` (``[out, in]``; int4's ``[out, in / 2]``), its scales
    ``weight_scale`` (FP8's and int8's ``[1, out]``, float32, per output channel; int4's per
    group, along dimension :attr:`SCALES_BY_OUTPUT` = 0), the bias, if any, added in the input's
    dtype, and the product of a call's rows (:meth:`rows`)."""

    QUANTIZED = ""  # the weight's buffer
    KIND = ""
    SCALES_BY_OUTPUT = 1  # weight_scale's dimension along the outputs
    weight_scale: Tensor

    def __init__(self, linear: nn.Module, weight: Tensor, scale: Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer(self.QUANTIZED, weight)
        self.register_buffer("weight_scale", scale.contiguous())
        bias = cast(Optional[Tensor], linear.bias)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.train(linear.training)  # (an eval model's layer stays in eval: a training one runs eagerly)

    @staticmethod
    def rows(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        """``x``'s rows ``[-1, in]`` times ``weight`` (this class's kind) scaled by ``scale``, in
        ``x``'s dtype: the product of a layer, or of layers whose weights lie one after another
        (:func:`together`)."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        out = self.rows(x, getattr(self, self.QUANTIZED), self.weight_scale)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.KIND}")

    def _apply(self, fn, recurse=True):
        # Device moves reach the quantized weight and its scales; dtype changes do not (E4M3
        # counts as a floating dtype: ``model.half()`` after quantize made an FP8 weight fp16
        # and the scales fp16, rounded, and the product refused them). They stay as they are,
        # what the product reads; the bias follows the model's dtype as before. A move copies a
        # view of a shared buffer alone (``quantize`` again lays the group out anew).
        kept = {n: t for n, t in self._buffers.items() if n in (self.QUANTIZED, "weight_scale") and t is not None}
        for n in kept:
            del self._buffers[n]
        try:
            super()._apply(fn, recurse)
        finally:
            for n, t in kept.items():
                probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
                if probe.dtype == t.dtype:  # (a move, to_empty: as any buffer)
                    self._buffers[n] = fn(t)
                else:
                    self._buffers[n] = t if t.device == probe.device else t.to(probe.device)
        return self


class Fp8Linear(QuantizedLinear):
    """``nn.Linear``'s product from FP8: ``weight_fp8 [out, in]`` (E4M3) and ``weight_scale
    [1, out]`` (float32, per output channel) made from the layer's weight; the input's rows
    scaled to E4M3 each call by their largest magnitude; the bias, if any, added in the input's
    dtype."""

    QUANTIZED = "weight_fp8"
    KIND = "fp8"
    weight_fp8: Tensor

    def __init__(self, linear: nn.Module):
        w = _weight(linear)
        scale = w.float().abs().amax(dim=1).clamp(min=TINY) / FP8_MAX
        super().__init__(linear, (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale[None, :])

    @staticmethod
    def rows(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        k = weight.shape[1]
        if getattr(_HERE, "exact", False):  # (see exact_products)
            return nn.functional.linear(x.reshape(-1, k), (weight.float() * scale.t()).to(x.dtype))
        q, s = _scaled(x, k) or rows_to_fp8(x.reshape(-1, k))
        return product(q, s, weight, scale, x.dtype)


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
        super().__init__(linear, (w / scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8),
                         scale[None, :])

    @staticmethod
    def rows(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        rows = x.reshape(-1, weight.shape[1])
        if (rows.is_cuda and rows.dtype in (torch.float16, torch.bfloat16) and _triton()
                and not torch.compiler.is_compiling()):
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            shape = int8_tile_shape(rows.shape[0], weight.shape[0], rows.shape[1], _compat.multiprocessors(rows.device))
            if shape is not None and weight.stride(1) == 1 and scale.is_contiguous():
                return int8_tiles(rows, weight, scale, shape)
            return few_rows(rows, None, weight, scale, rows.dtype)
        return nn.functional.linear(rows, (weight.to(torch.float32) * scale.t()).to(rows.dtype))


class Int4Linear(QuantizedLinear):
    """``nn.Linear``'s product from int4 weights (:mod:`.weight_only`): ``weight_int4 [out, in /
    2]`` (uint8, two values a byte) and ``weight_scale [out, in / 128, 2]`` (fp16: each group's
    scale and offset), the input as it is; the bias, if any, added in the input's dtype. On a GPU
    with Triton, in fp16 or bf16, graphwrap's kernel reads the packed bytes; elsewhere the weight
    made again in the input's dtype and torch's product."""

    QUANTIZED = "weight_int4"
    KIND = "int4"
    SCALES_BY_OUTPUT = 0
    weight_int4: Tensor

    def __init__(self, linear: nn.Module):
        weight, scale = weight_only.pack(_weight(linear))
        super().__init__(linear, weight, scale)
        self.in_features = weight.shape[1] * 2

    @staticmethod
    def rows(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        rows = x.reshape(-1, weight.shape[1] * 2)
        if (rows.is_cuda and rows.dtype in (torch.float16, torch.bfloat16) and _triton()
                and not torch.compiler.is_compiling()):
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            return weight_only.product(rows, weight, scale, _compat.multiprocessors(rows.device))
        return nn.functional.linear(rows, weight_only.unpack(weight, scale).to(rows.dtype))


def product(q: Tensor, scale: Tensor, weight: Tensor, weight_scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``(q * scale) @ (weight * weight_scale).T`` in ``dtype``: rows ``q [n, k]`` in E4M3 scaled
    ``[n, 1]``, ``weight [out, k]`` scaled ``[1, out]``. Up to :data:`ROWS` rows in fp16 or bf16
    on a GPU with Triton, graphwrap's kernel (:func:`few_rows`); more on a Hopper GPU where
    torch's tiles would leave SMs idle, graphwrap's E4M3 tiles (:func:`fp8_tile_shape`); else
    ``torch._scaled_mm``."""
    if not q.is_cuda:
        return torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=dtype)
    if dtype in (torch.float16, torch.bfloat16) and _triton() and not torch.compiler.is_compiling():
        if q.shape[0] <= ROWS:
            return few_rows(q, scale, weight, weight_scale, dtype)
        shape = _tiles_here(q, scale, weight, weight_scale)
        if shape is not None:
            return fp8_tiles(q, scale, weight, weight_scale, dtype, shape)
    out_dtype = dtype if _writes(q.device, dtype) else torch.bfloat16
    out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=out_dtype,
                           use_fast_accum=FAST_ACCUM)
    return out if out_dtype == dtype else out.to(dtype)


def few_rows(q: Tensor, scale: Optional[Tensor], weight: Tensor, weight_scale: Tensor, dtype: torch.dtype,
             bn: Optional[int] = None, bk: Optional[int] = None, split: Optional[int] = None,
             warps: Optional[int] = None, stages: Optional[int] = None, bm: Optional[int] = None) -> Tensor:
    """:func:`product` for a few rows (a decode step's at low load), in one Triton kernel that
    reads each weight once. torch's row-wise product costs at least about 13.5 us a call on an
    H200, where fp16's takes 8-14 us at such rows for the Llama-3-8B shape's smaller widths, so
    FP8 layers there were slower than fp16's (``benchmarks/diagnostics/fp8_products.py``: at one
    row, 10.9 / 9.1 / 17.1 / 23.4 us for the query-key-value, output, gate and down widths,
    against torch's 14.0 / 13.6 / 20.6 / 36.9). At 64 rows torch's is faster (14.2 against 23.0
    us for the query-key-value width): hence :data:`ROWS`. ``bn`` outputs a program, ``bk`` the
    inner dimension's step, ``split`` its parts (each a program's, then summed in a second kernel
    in a fixed order), ``warps``, ``stages``, ``bm`` (rows a program): the shape of work (None:
    :func:`shape_of_work`; ``fp8_products.py --tune``, one row). ``scale`` None: rows in fp16 or
    bf16 as they are and weights in int8 (:class:`Int8Linear`), at any number of rows (past
    :data:`ROWS`, :func:`tiles`). One row with no shape given goes to :func:`one_row` where
    :func:`row_shape` says it is faster."""
    import triton

    from ._fp8_triton import rows_product, sum_parts

    m, k = q.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=dtype, device=q.device)
    if m == 0:
        return out
    if m == 1 and bn is None and bk is None and split is None:
        row = row_shape(n, k, scale is not None)
        if row is not None:
            return one_row(q, scale, weight, weight_scale, out, *row)
    if m <= ROWS:
        shape = (min(64, max(16, 1 << (m - 1).bit_length())), *shape_of_work(n, k, _compat.multiprocessors(q.device)), 4, 4)
    else:
        shape = tiles(m)
    bm, bn, bk, split, warps, stages = (c if v is None else v
                                        for v, c in zip((bm, bn, bk, split, warps, stages), shape))
    parts = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=q.device)
    rows_product[(triton.cdiv(n, bn), triton.cdiv(m, bm), split)](
        q, weight_scale if scale is None else scale, weight.view(torch.uint8) if scale is None else weight,
        weight_scale, parts, m, n, k, q.stride(0),
        weight.stride(0), n, m * n, BM=bm, BN=bn, BK=bk, SPLIT=split, HAS_XS=scale is not None,
        BF16=scale is None and q.dtype == torch.bfloat16, num_warps=warps, num_stages=stages)
    if split > 1:
        sum_parts[(triton.cdiv(m * n, 1024),)](parts, out, m * n, SPLIT=split, BLOCK=1024, num_warps=4)
    return out


def fp8_tiles(q: Tensor, scale: Tensor, weight: Tensor, weight_scale: Tensor, dtype: torch.dtype,
              shape: Tuple[int, int, int, int, int], precise: bool = not FAST_ACCUM) -> Tensor:
    """:func:`product` on the tensor cores' own E4M3 products in graphwrap's Triton kernel
    (``_fp8_triton.fp8_tiles``), at ``shape``: ``(bm, bn, bk, warps, stages)``, rows and outputs
    a program, the inner dimension's step, warps, stages. The outputs must be a multiple of
    ``bn`` and the inner dimension of ``bk`` (:func:`fp8_tile_shape`). ``precise``: each step's
    sum added in full fp32; otherwise the whole inner dimension summed at the tensor cores' fast
    accumulation, as torch's product with :data:`FAST_ACCUM` (the same largest differences from
    the product written out, 0.3-1.2%, where each step added in fp32 makes them 0.04-0.06%; on an
    H200 that costs 10-30% up to 128 rows and 30-35% at 192 and 256, where it is torch's time)."""
    import triton

    from ._fp8_triton import fp8_tiles as kernel

    bm, bn, bk, warps, stages = shape
    m, k = q.shape
    n = weight.shape[0]
    if n % bn or k % bk:
        raise GraphwrapError(f"fp8_tiles: {n} outputs of {k} inputs do not divide into {shape}")
    out = torch.empty((m, n), dtype=dtype, device=q.device)
    if m:
        kernel[(triton.cdiv(m, bm), n // bn)](q, scale, weight, weight_scale, out, m, k, q.stride(0), weight.stride(0),
                                              n, BM=bm, BN=bn, BK=bk, EVEN_M=m % bm == 0, PRECISE=precise,
                                              num_warps=warps, num_stages=stages)
    return out


def fp8_tile_shape(m: int, n: int, k: int, processors: int) -> Optional[Tuple[int, int, int, int, int]]:
    """:func:`fp8_tiles`' shape of work for ``m`` rows of ``k`` inputs into ``n`` outputs on a
    Hopper chip of ``processors`` SMs, or None where ``torch._scaled_mm`` is kept.

    torch's row-wise FP8 product takes about the same time from 64 to 512 rows at the Llama-3-8B
    shape's widths: its tiles of 128 rows by 128 outputs make too few programs for the SMs
    there (64 for the output or down projection at 256 rows, on 132 SMs). So where those tiles
    would fill less than two thirds of the SMs, graphwrap's tiles take the product: 64 rows a
    program, by 64 outputs where that makes one wave of programs at most, else by 128 where
    that does (otherwise torch's: more than a wave of small tiles was slower); 256 inputs a step
    (128 where the inner dimension is no multiple of 256); 4 warps, 4 stages. On an H200
    (``fp8_products.py --native``, ``benchmarks/results/h200-2026-12-01-native/``) these were
    the fastest of 40 shapes (splitting the inner dimension never was) at 32 to 256 rows, and
    1.2-1.7x torch's product for the Llama-3-8B and 1.1B shapes' widths (at 256 rows of the
    8B's: the output projection 14.3 -> 11.0 us, down 39.0 -> 28.3)."""
    if -(-m // 128) * -(-n // 128) * 3 >= 2 * processors or n % 64 or k % 128:
        return None
    rows = -(-m // 64)
    bn = 64 if rows * (n // 64) <= processors else 128
    if n % bn or rows * (n // bn) > processors:
        return None
    return 64, bn, 256 if k % 256 == 0 else 128, 4, 4


def _tiles_here(q: Tensor, scale: Tensor, weight: Tensor, weight_scale: Tensor
                ) -> Optional[Tuple[int, int, int, int, int]]:
    """:func:`fp8_tile_shape` for this product on this device, or None: a chip that is not
    Hopper's (the shapes were measured there), or operands laid out other than :func:`fp8_tiles`
    reads them (rows and weights along their inner dimension, scales one after another)."""
    if (_capability(q.device)[0] != 9 or q.stride(1) != 1 or weight.stride(1) != 1
            or scale.numel() != q.shape[0] or not scale.is_contiguous() or not weight_scale.is_contiguous()):
        return None
    return fp8_tile_shape(q.shape[0], weight.shape[0], q.shape[1], _compat.multiprocessors(q.device))


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def int8_tiles(rows: Tensor, weight: Tensor, scale: Tensor, shape: Tuple[int, int, int, int, int]) -> Tensor:
    """An int8 weight-only layer's product of ``rows`` (fp16 or bf16) past :data:`ROWS` rows in
    graphwrap's Triton kernel (``_fp8_triton.int8_tiles``: the weights the left operand, made
    fp16 in registers), at ``shape``: ``(bm, bn, bk, warps, stages)`` (:func:`int8_tile_shape`)."""
    import triton

    from ._fp8_triton import int8_tiles as kernel

    bm, bn, bk, warps, stages = shape
    m, k = rows.shape
    n = weight.shape[0]
    if n % bn or k % bk:
        raise GraphwrapError(f"int8_tiles: {n} outputs of {k} inputs do not divide into {shape}")
    out = torch.empty((m, n), dtype=rows.dtype, device=rows.device)
    if m:
        kernel[(triton.cdiv(m, bm), n // bn)](rows, weight.view(torch.uint8), scale, out, m, k, rows.stride(0),
                                              weight.stride(0), n, BM=bm, BN=bn, BK=bk,
                                              BF16=rows.dtype == torch.bfloat16, num_warps=warps, num_stages=stages)
    return out


def int8_tile_shape(m: int, n: int, k: int, processors: int) -> Optional[Tuple[int, int, int, int, int]]:
    """:func:`int8_tiles`' shape of work for ``m`` rows of ``k`` inputs into ``n`` outputs (the
    arguments in :func:`fp8_tile_shape`'s order), or
    None (up to :data:`ROWS` rows, or widths it does not divide: :func:`few_rows`).

    Up to 1,024 rows: 64 outputs a program, 128 inputs a step, 4 warps; rows a program the
    fewest of 32, 64 and 128 whose programs make one wave at most, or where none does, the
    fewest that hold every row (at most 128); 4 stages where the programs are one wave at
    most, else 3. Past 1,024 rows (a forward of many prompts' positions): 128 rows by 128
    outputs, 64 inputs a step, 8 warps, 3 stages. On an H200
    (``benchmarks/diagnostics/swapped_tiles.py``, ``benchmarks/results/h200-2026-12-01-native/``),
    at 24 to 2,048 rows of the Llama-3-8B shape's widths these were the fastest of 48 shapes or
    within 5% of it. Against :func:`few_rows`' tiles, whose weights are the right operand and pass
    through shared memory, a layer's four products took 279 us against 523 at 256 rows (fp16's
    cuBLAS 182), 142 against 221 at 64 rows (fp16's 130), 2,110 against 2,450 at 2,048 rows
    (fp16's 1,318)."""
    if m <= ROWS or n % 64 or k % 128:
        return None
    if m > 1024 and n % 128 == 0:
        return 128, 128, 64, 8, 3
    fit = [bm for bm in (32, 64, 128) if (n // 64) * -(-m // bm) <= processors]
    bm = fit[0] if fit else next(bm for bm in (32, 64, 128) if bm >= m or bm == 128)
    return bm, 64, 128, 4, 4 if (n // 64) * -(-m // bm) <= processors else 3


def tiles(m: int) -> Tuple[int, int, int, int, int, int]:
    """:func:`few_rows`' ``(bm, bn, bk, split, warps, stages)`` for ``m`` rows past :data:`ROWS`
    (int8 weight-only layers whose widths :func:`int8_tiles` does not take): tiles of 64 rows by 64 outputs up to 64 rows, of 128 by 128 on 8
    warps past them. On an H200 (Llama-3-8B shape, ``benchmarks/results/h200-2026-11-30-one-row/``)
    the larger tiles took 256 requests at once from 0.52x fp16's tokens/s to 0.58x; at 256 rows
    alone (``fp8_products.py --int8-tiles``) tiles of 128 by 64 on 4 warps were faster for q/k/v,
    the output and down (51.0, 37.7, 125.7 us against 59.9, 59.1, 204.4), 128 by 128 on 4 for gate
    and up (159.4 against 179.4): a choice by width not yet measured end to end."""
    return (64, 64, 64, 1, 4, 4) if m <= 64 else (128, 128, 64, 1, 8, 3)


def one_row(q: Tensor, scale: Optional[Tensor], weight: Tensor, weight_scale: Tensor, out: Tensor, bn: int = 4,
            bk: int = 1024, warps: int = 4) -> Tensor:
    """:func:`few_rows` for one row into ``out [1, n]``, on the CUDA cores (``_fp8_triton.one_row``):
    ``bn`` outputs a program over the whole inner dimension, ``bk`` at a time, on ``warps``
    (:func:`row_shape`'s, or given: ``fp8_products.py --tune``)."""
    import triton

    from ._fp8_triton import one_row as kernel

    n, k = weight.shape
    bk = min(bk, max(16, 1 << (k - 1).bit_length()))
    kernel[(triton.cdiv(n, bn),)](q, weight_scale if scale is None else scale,
                                  weight.view(torch.int8) if scale is None else weight, weight_scale, out, n, k,
                                  weight.stride(0), BN=bn, BK=bk, HAS_XS=scale is not None,
                                  EVEN=n % bn == 0 and k % bk == 0, num_warps=warps)
    return out


def row_shape(n: int, k: int, fp8: bool) -> Optional[Tuple[int, int, int]]:
    """:func:`one_row`'s ``(bn, bk, warps)`` for ``n`` outputs of ``k`` inputs, or None where
    :func:`shape_of_work`'s tiles on the tensor cores are faster for one row. On an H200, the
    Llama-3-8B shape's widths at one row (``benchmarks/results/h200-2026-11-30-one-row/``; us,
    against those tiles): FP8 9.5 / 7.3 / 17.8 against 10.7 / 9.1 / 19.4 for q, k and v as one,
    the output and the down projection, and 4.4 against 7.8 for k or v alone; past 8,192 outputs
    FP8 keeps the tiles (the gate or the up projection alone, 14,336 outputs, 17.4 in tiles
    against 20.1; both as one, 28,672, 31.7 against 32.6). int8 at every width: 11.8 / 8.9 / 38.1
    / 23.4 against 15.6 / 10.3 / 41.9 / 23.4 (gate and up as one included), 22.6 against 23.2 for
    the gate alone. Four outputs a program on 4 warps; the inner dimension 1,024 at a time, but
    512 between 4,096 and 16,384 outputs (q, k and v as one: 9.5 against 10.5 us in FP8)."""
    if fp8 and n > 8192:
        return None
    return 4, 512 if 4096 < n <= 16384 else 1024, 4


def shape_of_work(n: int, k: int, processors: int) -> Tuple[int, int, int]:
    """:func:`few_rows`' ``(bn, bk, split)`` for ``n`` outputs of ``k`` inputs on a chip of
    ``processors`` SMs (``fp8_products.py --tune`` and ``--rows 1,16`` on an H200, the Llama-3-8B
    shape's widths):

    - outputs a program: 64 where that makes a program for half the SMs, else 32, else 16 (64
      for 6,144 and 14,336 outputs, 32 for 4,096, 16 for 1,024);
    - the inner dimension's step: 128 where the programs are more than twice the SMs, else 256
      (the gate and up projections as one, 28,672 outputs in 448 programs: 32.2 against 39.4 us
      at one row);
    - the inner dimension in 4 parts where it is at least 8,192 long and the programs fewer than
      the SMs (the down projection's 14,336 inputs in 128 programs: 19.7 against 23.8 us)."""
    bn = next((b for b in (64, 32) if 2 * -(-n // b) >= processors), 16)
    programs = -(-n // bn)
    return bn, 128 if programs > 2 * processors else 256, 4 if k >= 8192 and programs < processors else 1


_WRITES: Dict[Tuple[torch.device, torch.dtype], bool] = {}


def _writes(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch's row-wise FP8 product on ``device`` writes ``dtype`` (torch 2.11's
    cuBLASLt product on an H200 writes fp16; cutlass's row-wise kernel, which older builds take,
    writes bfloat16 only): tried once, on a matrix of ones, never while a CUDA graph is captured
    or torch.compile traces (bfloat16 then, which every build writes; a capture's warm-up has
    tried it already)."""
    if dtype == torch.bfloat16:
        return True
    key = (device, dtype)
    if key not in _WRITES:
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return False  # (not tried inside a trace or a capture: bfloat16, then cast)
        try:
            one = torch.ones((16, 16), dtype=FP8, device=device)
            torch._scaled_mm(one, one.t(), scale_a=torch.ones((16, 1), device=device),
                             scale_b=torch.ones((1, 16), device=device), out_dtype=dtype, use_fast_accum=FAST_ACCUM)
            _WRITES[key] = True
        except (RuntimeError, ValueError, TypeError):
            _WRITES[key] = False
    return _WRITES[key]


def together(x: Tensor, layers: Sequence[nn.Module]) -> Optional[List[Tensor]]:
    """Each of ``layers``' outputs for ``x`` from one product (FP8: of one scaling of ``x``),
    where they are quantized layers of one kind (:class:`Fp8Linear`, int8's
    :class:`Int8Linear`) without hooks whose weights and scales lie one after
    another in one buffer (:func:`quantize` lays out :data:`SHARED` so); None otherwise, and
    where products are exact on this thread (:func:`exact_products`). The outputs are views of
    the one product."""
    if (getattr(_HERE, "exact", False) or not layers or not all(_plain(m) for m in layers)
            or len({type(m) for m in layers}) != 1):
        return None
    mods = cast(Sequence[QuantizedLinear], layers)
    weight = _joined([getattr(m, m.QUANTIZED) for m in mods], 0)
    scale = _joined([m.weight_scale for m in mods], mods[0].SCALES_BY_OUTPUT)
    if weight is None or scale is None or mods[0].in_features != x.shape[-1] or weight.device != x.device:
        return None
    out = mods[0].rows(x, weight, scale)
    outs, at = [], 0
    for m in mods:
        part = out[:, at:at + m.out_features]
        at += m.out_features
        if m.bias is not None:
            part = part + m.bias
        outs.append(part.reshape(*x.shape[:-1], m.out_features))
    return outs


def gated(x: Tensor, gate: nn.Module, up: nn.Module, down: nn.Module) -> Optional[Tensor]:
    """``down(silu(gate(x)) * up(x))`` for FP8 layers without hooks: ``x`` scaled to E4M3 once for
    the gate and the up projection, and SiLU, the product and the down projection's row scaling
    in one kernel (``silu_product_to_fp8``: on an H200 at 256 rows of the Llama-3-8B shape, three
    kernels of 4.8, 5.4 and 7.7 us before); None where that kernel does not run here (a CPU, no
    Triton, rows wider than :data:`WIDEST`, another dtype than fp16 and bf16, exact products on
    this thread) or the layers' widths do not chain. Weight-only layers (int8, int4) whose gate
    and up share a buffer: their two products as one (:func:`together`), then the module's own
    steps."""
    if type(gate) in (Int8Linear, Int4Linear):
        pair = together(x, [gate, up])
        return None if pair is None else down(nn.functional.silu(pair[0]) * pair[1])
    if (getattr(_HERE, "exact", False) or not all(type(m) is Fp8Linear and _plain(m) for m in (gate, up, down))
            or not x.is_cuda
            or x.dtype not in (torch.float16, torch.bfloat16) or not _triton() or torch.compiler.is_compiling()):
        return None
    d = cast(Fp8Linear, down)
    if d.in_features > WIDEST:
        return None
    from ._fp8_triton import silu_product_to_fp8

    gm, um = cast(Fp8Linear, gate), cast(Fp8Linear, up)
    if not (gm.in_features == um.in_features == x.shape[-1] and gm.out_features == um.out_features == d.in_features):
        return None
    xq, xs = _scaled(x, gm.in_features) or rows_to_fp8(x.reshape(-1, gm.in_features))  # (once for both)
    joined = _joined([gm.weight_fp8, um.weight_fp8], 0), _joined([gm.weight_scale, um.weight_scale], 1)
    if joined[0] is not None and joined[1] is not None:  # (one buffer, quantize's: one product, its two halves)
        both = product(xq, xs, joined[0], joined[1], x.dtype)
        g, u = both[:, :gm.out_features], both[:, gm.out_features:]
    else:
        g = product(xq, xs, gm.weight_fp8, gm.weight_scale, x.dtype)
        u = product(xq, xs, um.weight_fp8, um.weight_scale, x.dtype)
    if gm.bias is not None:
        g = g + gm.bias
    if um.bias is not None:
        u = u + um.bias
    m, k = g.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = 1 << max(4, (k - 1).bit_length())
        silu_product_to_fp8[(m,)](g, u, q, scale, g.stride(0), u.stride(0), q.stride(0), k, FP8_MAX=FP8_MAX,
                                  INV_MAX=INV_MAX, TINY=TINY, BLOCK=block, num_warps=_warps(block))
    out = product(q, scale, d.weight_fp8, d.weight_scale, x.dtype)
    if d.bias is not None:
        out = out + d.bias
    return out.reshape(*x.shape[:-1], d.out_features)


def _plain(m: nn.Module) -> bool:
    from torch.nn.modules import module as g

    return (isinstance(m, QuantizedLinear) and not (m._forward_hooks or m._forward_pre_hooks or g._global_forward_hooks
                                          or g._global_forward_pre_hooks))


def _joined(parts: Sequence[Tensor], dim: int) -> Optional[Tensor]:
    """The dense tensor ``parts`` make along ``dim`` where they are its consecutive views (each
    dense, the next beginning where the last ends in one storage), else None. Along a dimension
    past the first, the dimensions before it must be 1 (scales ``[1, out]``)."""
    first = parts[0]
    at = first.storage_offset()
    for t in parts:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.device != first.device or t.storage_offset() != at
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.shape[:dim] != first.shape[:dim] or t.shape[dim + 1:] != first.shape[dim + 1:]):
            return None
        at += t.numel()
    if any(n != 1 for n in first.shape[:dim]):
        return None  # (along a later dimension the views are dense only where those before are 1)
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in parts)
    strides: List[int] = []
    step = 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape, strides)


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
                                 BLOCK=block, num_warps=_warps(block))
    return q, scale


def normed(x: Tensor, weight: Tensor, eps: float) -> Optional[Tensor]:
    """RMSNorm of ``x`` (``weight * x * rsqrt(mean(x^2) + eps)``, in fp32 rounded once to ``x``'s
    dtype) from one kernel that also writes the result's rows in E4M3 with their scales, for the
    FP8 layers the result goes to next (:data:`FEEDS`): their call finds them (:func:`_scaled`)
    and does not scale the rows again, one kernel less before each attention's and each MLP's
    products. The rows and scales are :func:`rows_to_fp8`'s of the result, bit for bit. None
    where that kernel does not run here: a CPU, no Triton, another dtype than fp16 and bf16, a
    weight of another dtype, rows wider than :data:`WIDEST`, exact products on this thread, an
    inference tensor (which keeps no version counter to check the rows against)."""
    n = x.shape[-1]
    if (getattr(_HERE, "exact", False) or not x.is_cuda or x.is_inference() or x.dtype not in (torch.float16, torch.bfloat16)
            or weight.dtype != x.dtype or weight.shape != (n,) or weight.stride(0) != 1 or weight.device != x.device
            or n > WIDEST or not _triton() or torch.compiler.is_compiling()):
        return None
    from ._fp8_triton import rms_norm_to_fp8

    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    q = torch.empty(rows.shape, dtype=FP8, device=x.device)
    scale = torch.empty((rows.shape[0], 1), dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        block = 1 << max(4, (n - 1).bit_length())
        rms_norm_to_fp8[(rows.shape[0],)](rows, weight, out, q, scale, rows.stride(0), out.stride(0), q.stride(0), n,
                                          float(eps), FP8_MAX=FP8_MAX, INV_MAX=INV_MAX, TINY=TINY, BLOCK=block,
                                          num_warps=_warps(block))
    y = out.view(x.shape)
    _HERE.scaled = (y, y._version, q, scale)
    return y


def _scaled(x: Tensor, k: int) -> Optional[Tuple[Tensor, Tensor]]:
    """``x``'s rows in E4M3 and their scales where :func:`normed` made ``x`` on this thread and
    it is as it was made (the same tensor, not written since), else None."""
    made = getattr(_HERE, "scaled", None)
    if made is None or made[0] is not x or x._version != made[1] or made[2].shape != (x.numel() // max(k, 1), k):
        return None
    return made[2], made[3]


def forget() -> None:
    """Let go of what :func:`normed` kept on this thread (the end of a forward)."""
    _HERE.scaled = None


def rows_to_fp8_reference(rows: Tensor) -> Tuple[Tensor, Tensor]:
    """What :func:`rows_to_fp8` computes, in torch steps."""
    scale = rows.float().abs().amax(dim=1, keepdim=True).clamp(min=TINY) / FP8_MAX
    return (rows.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _warps(block: int) -> int:
    """Warps for graphwrap's kernels that take one row a program ``block`` wide (rows_to_fp8,
    normed, gated's): one per 256 columns, up to 32 (on an H200, at 1 and 256 rows: 4,096 wide in
    16 warps 1.79 and 2.48 us against 2.01 and 2.63 in 8; 14,336 in 32, 5.45 and 8.46 against
    6.88 and 9.59)."""
    return max(1, min(32, block // 256))


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
    ``"fp8"``, or ``"int8"`` or ``"int4"`` weight-only. The modules named (last part of the name)
    in ``skip`` are left as they are, and FP8 layers of sizes not multiples of 16, and int4 layers
    whose inputs are not a multiple of 128. The log says how many were quantized."""
    if kind not in KINDS:
        raise GraphwrapError(f"quantize: kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    skip = set(skip)
    if kind in ("int8", "int4"):
        return _weight_only(model, skip, kind)
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
    shared = [sum(n) for n in zip(*(_share(module) for module in model.modules()))] or [0] * len(SHARED)
    normed = 0
    for module in model.modules():
        for norm, sibling, first in FEEDS:
            if hasattr(module, norm) and type(getattr(getattr(module, sibling, None), first, None)) is Fp8Linear:
                setattr(getattr(module, norm), NORMED, True)
                normed += 1
    if not counts["quantized"]:
        logger.warning("quantize %s: no linear layer of this model could be quantized (%d by name, %d by size): it "
                       "runs as it was", kind, counts["skipped"], counts["sizes"])
    logger.info("quantize %s: %d linear layers in FP8 (sharing a buffer: %s; %d norms scale their rows for them); %d "
                "left as they are by name (%s), %d whose sizes are not multiples of 16", kind, counts["quantized"],
                ", ".join(f"{n} groups of {'/'.join(g)}" for g, n in zip(SHARED, shared)), normed, counts["skipped"],
                ", ".join(sorted(skip)) or "none", counts["sizes"])
    return model


def _share(module: nn.Module) -> List[int]:
    """Lays out each group of :data:`SHARED` among ``module``'s children that are quantized
    layers of one kind, one input width and one device, not yet shared, in one buffer of weights and one of scales,
    each layer's weight and scale a view of them (:func:`together`, :func:`gated`); how many of
    each group (1 or 0)."""
    done = []
    for names in SHARED:
        done.append(0)
        layers = [getattr(module, n, None) for n in names]
        if not (isinstance(layers[0], QuantizedLinear) and all(type(m) is type(layers[0]) for m in layers)):
            continue
        mods = cast(List[QuantizedLinear], layers)
        name = mods[0].QUANTIZED
        first = getattr(mods[0], name)
        if any(m.in_features != mods[0].in_features or getattr(m, name).device != first.device for m in mods):
            continue
        if _joined([getattr(m, name) for m in mods], 0) is not None:
            continue  # (shared already)
        by = mods[0].SCALES_BY_OUTPUT
        weight = torch.cat([getattr(m, name) for m in mods])
        scale = torch.cat([m.weight_scale for m in mods], dim=by)
        at = 0
        for m in mods:
            m._buffers[name] = weight[at:at + m.out_features]
            m._buffers["weight_scale"] = scale.narrow(by, at, m.out_features)
            at += m.out_features
        done[-1] = 1
    return done


def _weight_only(model: nn.Module, skip: Set[str], kind: str) -> nn.Module:
    """``model``'s linear layers (``nn.Linear``, ``Conv1D``) but those named in ``skip`` as
    :class:`Int8Linear` or :class:`Int4Linear` (``kind``), in place, each group of :data:`SHARED`
    in one buffer. int4 leaves layers whose inputs are not a multiple of its groups' 128, or
    whose groups' scales are past fp16's range (:func:`.weight_only.fits`); the log counts each."""
    cls = Int8Linear if kind == "int8" else Int4Linear
    targets, left = [], {"name": 0, "size": 0, "range": 0}
    for module in model.modules():
        for name, child in module.named_children():
            if not _linear(child):
                continue
            why = "name" if name in skip else (weight_only.fits(_weight(child)) if cls is Int4Linear else None)
            if why:
                left[why] += 1
            else:
                targets.append((module, name, child))
    for module, name, child in targets:
        setattr(module, name, cls(child))
    shared = [sum(n) for n in zip(*(_share(m) for m in model.modules()))] or [0] * len(SHARED)
    sizes = (f", {left['size']} whose inputs are not a multiple of {weight_only.GROUP}, {left['range']} past fp16's "
             "range" if cls is Int4Linear else "")
    logger.info("quantize %s: %d linear layers in %s weight-only (sharing a buffer: %s); %d left as they are by "
                "name (%s)%s", kind, len(targets), kind, ", ".join(f"{n} groups of {'/'.join(g)}"
                                                                   for g, n in zip(SHARED, shared)),
                left["name"], ", ".join(sorted(skip)) or "none", sizes)
    if not targets:
        logger.warning("quantize %s: no linear layer of this model could be quantized: it runs as it was", kind)
    return model
