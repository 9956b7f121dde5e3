"""int4 tiles with each group's low and high values joined into one product of 128 inputs (one
tensor-core chain and one wait a group, not two), the rows read in the matching order."""
import itertools
import sys
import time

sys.path.insert(0, "benchmarks/diagnostics")
import torch
import triton
import triton.language as tl

from graphwrap import weight_only
from graphwrap._fp8_triton import sum_parts
from graphwrap._int4_triton import _nibbles
from graphwrap.quantized import Int4Linear

DEV = torch.device("cuda")


@triton.jit
def joined(X, W, S, O, M, GROUPS, PER, sxm, swn, ssn, som, sop, BM: tl.constexpr, BN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rj = tl.arange(0, 64)
    rr = tl.arange(0, 128)
    first = tl.program_id(2) * PER
    wp = W + rn[:, None] * swn + first * 64 + rj[None, :]
    xo = rr // 2 + (rr % 2) * 64
    xp = X + rm[None, :] * sxm + first * 128 + xo[:, None]
    sp = S + rn * ssn + first
    rows = rm[None, :] < M
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for _ in range(first, tl.minimum(first + PER, GROUPS)):
        lo, hi = _nibbles(tl.load(wp))
        pair = tl.load(sp)
        scale = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)[:, None]
        offset = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)[:, None]
        w = tl.reshape(tl.join(lo, hi), (BN, 128))
        x = tl.load(xp, mask=rows, other=0.0)
        acc = tl.dot(w * scale + offset, x, acc)
        wp += 64
        xp += 128
        sp += 1
    at = O + tl.program_id(2) * sop + rm[None, :] * som + rn[:, None]
    tl.store(at, acc.to(O.dtype.element_ty), mask=rows)


def run(x, w4, s4, shape):
    bm, bn, split, warps, stages = shape
    m, k = x.shape
    n = w4.shape[0]
    groups = k // 128
    per = -(-groups // split)
    split = -(-groups // per)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    parts = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    joined[(triton.cdiv(m, bm), n // bn, split)](
        x, w4, s4.view(torch.int32), parts, m, groups, per, x.stride(0), w4.stride(0), s4.stride(0) // 2, n, m * n,
        BM=bm, BN=bn, num_warps=warps, num_stages=stages)
    if split > 1:
        sum_parts[(triton.cdiv(m * n, 1024),)](parts, out, m * n, SPLIT=split, BLOCK=1024, num_warps=4)
    return out


if __name__ == "__main__":
    from fp8_products import WIDTHS
    from piece_attention import graph_ms
    from step_products import _copies
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, time.strftime("%Y-%m-%d"), flush=True)
    g = torch.Generator(device=DEV).manual_seed(8)
    for rows in (1, 16, 64):
        for label in ("q, k and v as one", "q or o", "gate and up as one", "down"):
            k, n = WIDTHS[label]
            x = torch.randn(rows, k, generator=g, device=DEV).half()
            layer = Int4Linear(torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.float16))
            w4, s4 = layer.weight_int4, layer.weight_scale
            want = x.float() @ weight_only.unpack(w4, s4).t()
            chosen = weight_only.tile_shape(rows, n, k, sms)
            turn = itertools.cycle(_copies([w4, s4]))
            base = graph_ms(lambda: weight_only.tiles(x, *next(turn), chosen))
            ref = weight_only.tiles(x, w4, s4, chosen)
            line = f"{rows} rows, {label}: tiles {chosen} {1e3*base:.1f} us; joined:"
            for stages in (2, 3, 4):
                shape = (*chosen[:4], stages)
                try:
                    got = run(x, w4, s4, shape)
                    err = ((got.float() - want).abs().max() / want.abs().max()).item()
                    same = (got.float() - ref.float()).abs().max().item()
                    t = graph_ms(lambda: run(x, *next(turn), shape))
                    line += f" stages {stages} {1e3*t:.1f} us ({base/t:.2f}x, err {err:.1e}, from tiles {same:.1e});"
                except Exception as e:
                    line += f" stages {stages} {type(e).__name__} {str(e)[:150]};"
            print(line, flush=True)
