"""What graphwrap's int4 tiles (``weight_only.tiles``) spend on the chip at a few rows: the same
kernel with the packed values made fp16 in three ways, timed over weights past the L2 cache
("cold") and over one copy ("hot"), with what the compiler made of each (layout conversions
and shared memory in its Triton GPU IR, shared-memory and tensor-core instructions in its PTX):

- ``asm``: :func:`graphwrap._int4_triton._nibbles` (byte permutes and ``lop3``, four bytes an
  instruction sequence), as ``int4_tiles`` does;
- ``bits``: the same trick in Triton's own integer operations (each byte widened to 16 bits,
  its four bits or'ed under fp16 1024's bits, 1024 taken off), which the compiler may place in
  any layout;
- ``convert``: each four bits converted from an integer.

Ten calls in a CUDA graph, median of 20, each checked against the unpacked weight's product.
``python3 benchmarks/diagnostics/int4_dequant.py [--rows 1,16]`` from the repository root, on a
Hopper GPU.
"""

import argparse
import itertools
import re
import time

import torch
import triton
import triton.language as tl
from fp8_products import WIDTHS
from piece_attention import graph_ms
from step_products import _copies

from graphwrap import weight_only
from graphwrap._fp8_triton import sum_parts
from graphwrap._int4_triton import _nibbles
from graphwrap.quantized import Int4Linear

DEV = torch.device("cuda")
LABELS = ("q, k and v as one", "q or o", "gate and up as one", "down")
WAYS = ("asm", "bits", "convert")


@triton.jit
def _values(b, WAY: tl.constexpr):
    if WAY == 0:
        lo, hi = _nibbles(b)
    elif WAY == 1:
        w = b.to(tl.int16)
        lo = ((w & 15) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        hi = ((w >> 4) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    else:
        lo = (b & 15).to(tl.float16)
        hi = (b >> 4).to(tl.float16)
    return lo, hi


@triton.jit
def tiles(X, W, S, O, M, GROUPS, PER, sxm, swn, ssn, som, sop, BM: tl.constexpr, BN: tl.constexpr,
          WAY: tl.constexpr):
    """``graphwrap._int4_triton.int4_tiles`` (fp16 rows) with the values made as ``WAY`` says."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rj = tl.arange(0, 64)
    first = tl.program_id(2) * PER
    wp = W + rn[:, None] * swn + first * 64 + rj[None, :]
    xp = X + rm[None, :] * sxm + first * 128 + rj[:, None]
    sp = S + rn * ssn + first
    rows = rm[None, :] < M
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for _ in range(first, tl.minimum(first + PER, GROUPS)):
        lo, hi = _values(tl.load(wp), WAY)
        pair = tl.load(sp)
        scale = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)[:, None]
        offset = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)[:, None]
        xl = tl.load(xp, mask=rows, other=0.0)
        xh = tl.load(xp + 64, mask=rows, other=0.0)
        acc = tl.dot(lo * scale + offset, xl, acc)
        acc = tl.dot(hi * scale + offset, xh, acc)
        wp += 64
        xp += 128
        sp += 1
    at = O + tl.program_id(2) * sop + rm[None, :] * som + rn[:, None]
    tl.store(at, acc.to(O.dtype.element_ty), mask=rows)


def run(x, w4, s4, shape, way, kernels=None):
    bm, bn, split, warps, stages = shape
    m, k = x.shape
    n = w4.shape[0]
    groups = k // 128
    per = -(-groups // split)
    split = -(-groups // per)
    out = torch.empty((m, n), dtype=x.dtype, device=DEV)
    parts = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=DEV)
    kernel = tiles[(triton.cdiv(m, bm), n // bn, split)](
        x, w4, s4.view(torch.int32), parts, m, groups, per, x.stride(0), w4.stride(0), s4.stride(0) // 2, n, m * n,
        BM=bm, BN=bn, WAY=way, num_warps=warps, num_stages=stages)
    if kernels is not None:
        kernels.append(kernel)
    if split > 1:
        sum_parts[(triton.cdiv(m * n, 1024),)](parts, out, m * n, SPLIT=split, BLOCK=1024, num_warps=4)
    return out


def made(kernel) -> str:
    """What the compiler made: layout conversions and shared-memory buffers in the Triton GPU
    IR, shared-memory and tensor-core instructions in the PTX, registers a thread."""
    ir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    count = {"convert_layout": ir.count("ttg.convert_layout"), "local_alloc": ir.count("ttg.local_alloc"),
             "st.shared": len(re.findall(r"\bst\.shared", ptx)), "ld.shared": len(re.findall(r"\bld\.shared", ptx)),
             "ldmatrix": ptx.count("ldmatrix"), "stmatrix": ptx.count("stmatrix"), "wgmma": ptx.count("wgmma.mma_async"),
             "mma.sync": ptx.count("mma.sync"), "shfl": ptx.count("shfl.sync")}
    regs = getattr(kernel, "n_regs", None)
    return ", ".join(f"{k} {v}" for k, v in count.items()) + f"; registers {regs}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16")
    a = ap.parse_args()
    print(f"int4_dequant: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    g = torch.Generator(device=DEV).manual_seed(4)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    said = set()
    for rows in [int(r) for r in a.rows.split(",")]:
        for label in LABELS:
            k, n = WIDTHS[label]
            x = torch.randn(rows, k, generator=g, device=DEV).half()
            layer = Int4Linear(torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.float16))
            w4, s4 = layer.weight_int4, layer.weight_scale
            want = x.float() @ weight_only.unpack(w4, s4).t()
            shape = weight_only.tile_shape(rows, n, k, sms)
            turn = itertools.cycle(_copies([w4, s4]))
            base = graph_ms(lambda: weight_only.tiles(x, *next(turn), shape))
            print(f"  {rows} rows, {label} [{k}, {n}], {shape}: weight_only.tiles {1e3 * base:.1f} us", flush=True)
            for way, name in enumerate(WAYS):
                kernels = []
                got = run(x, w4, s4, shape, way, kernels)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                cold = graph_ms(lambda: run(x, *next(turn), shape, way))
                hot = graph_ms(lambda: run(x, w4, s4, shape, way))
                print(f"    {name:8s} cold {1e3 * cold:6.1f} us ({n * k / 2e9 / cold:.2f} TB/s), hot {1e3 * hot:6.1f} "
                      f"us, largest difference {err:.1e}", flush=True)
                key = (name, shape[0])
                if key not in said:
                    said.add(key)
                    print(f"      {made(kernels[0])}", flush=True)


if __name__ == "__main__":
    main()
