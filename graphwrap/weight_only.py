"""Int4 weights, graphwrap's own: how :class:`~.quantized.Int4Linear` packs them and makes its
product (``graphwrap.quantize(model, "int4")``).

For one stream and small batches a decode step is bound by reading the weights, and int4
weight-only layers read a little over a quarter of fp16's bytes. Each weight is a value 0-15 in
groups of :data:`GROUP` inputs, each group with a scale and an offset (a weight is ``offset +
value * scale``: the group's smallest weight and its range over 15, both in fp16), two values a
byte (:func:`pack`). On a GPU with Triton, in fp16 or bf16, graphwrap's kernels make the
product reading those bytes (:func:`product`) on the tensor cores: up to :data:`SWAPPED` rows
(decode steps) ``_int4_triton.int4_tiles``, the weights made whole in registers; more, and
widths those tiles do not divide, ``int4_product``. Elsewhere the layer makes the weight again
(:func:`unpack`) and takes torch's product.
Every step is a device operation, so graphs capture and replay it like any other.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from .errors import GraphwrapError

GROUP = 128  # inputs sharing a scale and an offset (the kernel's step)
HALF = GROUP // 2  # a group's bytes: input j in the low four bits of byte j, input HALF + j in the high four
LEVELS = 15  # the largest value (four bits)
ROWS = 16  # at most this many rows take int4_product's shape_of_work; more, TILES
TILES = (64, 64, 1, 4, 3)  # past ROWS rows: (rows, outputs a program, parts, warps, stages)
WIDE = 64  # past this many rows, 128 outputs a program (the tiles' tune on an H200: 64 rows 64, 256 rows 128)
SWAPPED = 64  # at most this many rows take the tiles with the weights the left operand (tile_shape)


def pack(weight: Tensor) -> Tuple[Tensor, Tensor]:
    """``weight [out, in]`` (``in`` a multiple of :data:`GROUP`) as its int4 bytes ``[out, in / 2]``
    (uint8) and each group's scale and offset ``[out, in / GROUP, 2]`` (fp16). The scale and
    offset are rounded to fp16 first, and each value is the nearest of 0-15 on that grid; a group
    of one value keeps it as its offset."""
    w = weight.detach().float()
    out, k = w.shape
    groups = w.reshape(out, k // GROUP, GROUP)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scale = ((high - low) / LEVELS).to(torch.float16)
    offset = low.to(torch.float16)
    step = scale.float()[..., None]
    values = ((groups - offset.float()[..., None]) / torch.where(step > 0, step, torch.ones_like(step)))
    values = torch.where(step > 0, values.round().clamp(0, LEVELS), torch.zeros_like(values)).to(torch.uint8)
    bytes_ = values[..., :HALF] | (values[..., HALF:] << 4)
    return bytes_.reshape(out, k // 2).contiguous(), torch.stack([scale, offset], dim=2).contiguous()


def unpack(packed: Tensor, scales: Tensor) -> Tensor:
    """The weight ``[out, in]`` (float32) that :func:`pack`'s bytes and scales stand for."""
    out, half = packed.shape
    b = packed.reshape(out, half // HALF, HALF)
    values = torch.cat([b & 0xF, b >> 4], dim=2).float()
    s = scales.float()
    return (s[..., 1:] + values * s[..., :1]).reshape(out, half * 2)


def fits(weight: Tensor) -> Optional[str]:
    """Why ``weight [out, in]`` cannot be packed (None where it can): its inputs are not a
    multiple of :data:`GROUP`, or its groups' scales or offsets are past fp16's range."""
    if weight.shape[1] % GROUP:
        return "size"
    w = weight.detach().float().reshape(weight.shape[0], -1, GROUP)
    if not (torch.isfinite(w.amin(dim=2).half()).all() and torch.isfinite(((w.amax(dim=2) - w.amin(dim=2)) / LEVELS)
                                                                         .half()).all()):
        return "range"
    return None


def product(rows: Tensor, weight: Tensor, scale: Tensor, processors: int, bm: Optional[int] = None,
            bn: Optional[int] = None, split: Optional[int] = None, warps: Optional[int] = None,
            stages: Optional[int] = None) -> Tensor:
    """``rows [m, in]`` (fp16 or bf16, on a GPU) times the int4 weight ``weight``, ``scale``
    (:func:`pack`'s), in ``rows``' dtype, on a chip of ``processors`` SMs. Where
    :func:`tile_shape` gives a shape (up to :data:`SWAPPED` rows), :func:`tiles`; else
    ``int4_product``: up to :data:`ROWS`, tiles of 16 rows in the shape of work of
    :func:`shape_of_work`; more, tiles of :data:`TILES` (:data:`WIDE`). ``bm``, ``bn``,
    ``split``, ``warps``, ``stages``: ``int4_product``'s shape given (``fp8_products.py
    --weight-only --tune``)."""
    import triton

    from ._fp8_triton import sum_parts
    from ._int4_triton import int4_product

    m, k = rows.shape
    n = weight.shape[0]
    if bm is None and bn is None:
        swapped = tile_shape(m, n, k, processors)
        if swapped is not None:
            return tiles(rows, weight, scale, swapped)
    out = torch.empty((m, n), dtype=rows.dtype, device=rows.device)
    if m == 0:
        return out
    if m <= ROWS:
        shape = (16, *shape_of_work(n, k, processors))
    else:
        shape = (TILES[0], 128 if m > WIDE else TILES[1], *TILES[2:])
    bm, bn, split, warps, stages = (c if v is None else v for v, c in zip((bm, bn, split, warps, stages), shape))
    parts = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=rows.device)
    groups = k // GROUP
    int4_product[(triton.cdiv(n, bn), triton.cdiv(m, bm), split)](
        rows, weight, scale, parts, m, n, groups, -(-groups // split), rows.stride(0), weight.stride(0), scale.stride(0),
        n, m * n, BM=bm, BN=bn, SPLIT=split, BF16=rows.dtype == torch.bfloat16, num_warps=warps, num_stages=stages)
    if split > 1:
        sum_parts[(triton.cdiv(m * n, 1024),)](parts, out, m * n, SPLIT=split, BLOCK=1024, num_warps=4)
    return out


def tiles(rows: Tensor, weight: Tensor, scale: Tensor, shape: Tuple[int, int, int, int, int]) -> Tensor:
    """:func:`product` by ``int4_tiles`` (the weights made whole in registers, the left operand) at
    ``shape``: ``(bm, bn, split, warps, stages)``, rows and outputs a program, the groups in
    ``split`` parts (:func:`tile_shape`)."""
    import triton

    from ._fp8_triton import sum_parts
    from ._int4_triton import int4_tiles

    bm, bn, split, warps, stages = shape
    m, k = rows.shape
    n = weight.shape[0]
    if n % bn:
        raise GraphwrapError(f"int4 tiles: {n} outputs do not divide into {bn}")
    out = torch.empty((m, n), dtype=rows.dtype, device=rows.device)
    if m == 0:
        return out
    groups = k // GROUP
    per = -(-groups // split)
    split = -(-groups // per)
    parts = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=rows.device)
    int4_tiles[(triton.cdiv(m, bm), n // bn, split)](
        rows, weight, scale.view(torch.int32), parts, m, groups, per, rows.stride(0), weight.stride(0),
        scale.stride(0) // 2, n, m * n, BM=bm, BN=bn, BF16=rows.dtype == torch.bfloat16, num_warps=warps,
        num_stages=stages)
    if split > 1:
        sum_parts[(triton.cdiv(m * n, 1024),)](parts, out, m * n, SPLIT=split, BLOCK=1024, num_warps=4)
    return out


def tile_shape(m: int, n: int, k: int, processors: int) -> Optional[Tuple[int, int, int, int, int]]:
    """:func:`tiles`' shape of work for ``m`` rows of ``k`` inputs into ``n`` outputs on a chip of
    ``processors`` SMs (the arguments in ``quantized.int8_tile_shape``'s order), or None: more
    than :data:`SWAPPED` rows or widths it does not divide (``int4_product``'s tiles, the
    weights the right operand).

    128 outputs a program (64 where they do not divide), 4 warps, 3 stages; 16 rows a program up
    to :data:`ROWS` rows, 32 up to 32, past them 64 where a tile of rows in the most parts
    outnumbers the SMs, else 32; the groups in the fewest of 1, 2, 4 and 8 parts (4 at most past
    :data:`ROWS` rows) that make six programs an SM, or the most. On an H200
    (``benchmarks/diagnostics/swapped_tiles.py --only int4``,
    ``benchmarks/results/h200-2026-12-01-int4-tiles/``), the Llama-3-8B shape's widths (q/k/v,
    output, gate and up, down), us: at one row 12.6, 10.6, 34.0, 21.3 against 11.8, 11.0, 41.4,
    25.7 for the CUDA cores' kernel that took one row before (fp16's cuBLAS 16.4, 13.8, 57.2,
    31.6); at 16 rows 12.9, 11.0, 36.4, 21.3 against 19.5, 13.7, 62.8, 34.1 for
    ``int4_product``'s tiles (fp16's 16.0, 13.7, 59.5, 32.5); at 64 rows 20.9, 15.2, 69.5, 36.0
    against 38.5, 39.8, 110.2, 131.2 (fp16's 16.5, 12.2, 61.1, 39.3)."""
    if m > SWAPPED or k % GROUP:
        return None
    bn = next((b for b in (128, 64) if n % b == 0), None)
    if bn is None:
        return None
    most = 8 if m <= ROWS else 4
    bm = 16 if m <= ROWS else 64 if m > 32 and (n // bn) * most > processors else 32
    programs = -(-m // bm) * (n // bn)
    split = next((s for s in (1, 2, 4) if programs * s >= 6 * processors), most)
    return bm, bn, min(split, k // GROUP), 4, 3


def shape_of_work(n: int, k: int, processors: int) -> Tuple[int, int, int, int]:
    """:func:`product`'s ``(bn, split, warps, stages)`` for ``int4_product``'s tiles of up to
    :data:`ROWS` rows (widths :func:`tiles` does not divide, or its shape given) of ``n`` outputs of ``k`` inputs on a chip of
    ``processors`` SMs: 128 outputs a program, the groups in 4 parts, 4 warps, 3 stages
    (``fp8_products.py --weight-only --tune`` on an H200 at 16 rows, the Llama-3-8B shape's
    widths: 19.4, 13.5 and 34.1 us for the q/k/v, output and down widths against 18.7, 15.1 and
    39.6 with 64 outputs and 2 warps; gate and up as one 54.9-56.7 with 2 warps against 73.9)."""
    return 128, 4, 4, 3
