"""Call 9: graphwrap's int4 tiles (``int4_dequant.py``'s copy, ``asm``) with Triton's
``maxnreg`` (96, 80, 64 registers a thread against the compiler's 128: more programs an SM), at
the rule's split and half of it, 2 and 3 stages, one and 16 rows, beside ``weight_only.tiles``.
Run from the repository root with ``PYTHONPATH`` there."""
import itertools
import sys
import time

sys.path.insert(0, "benchmarks/diagnostics")
import int4_dequant as D
import torch
import triton
from fp8_products import WIDTHS
from piece_attention import graph_ms
from step_products import _copies

from graphwrap import weight_only
from graphwrap._fp8_triton import sum_parts
from graphwrap.quantized import Int4Linear

DEV = torch.device("cuda")
sms = torch.cuda.get_device_properties(DEV).multi_processor_count

def run(x, w4, s4, shape, regs, ks=None):
    bm, bn, split, warps, stages = shape
    m, k = x.shape
    n = w4.shape[0]
    groups = k // 128
    per = -(-groups // split)
    split = -(-groups // per)
    out = torch.empty((m, n), dtype=x.dtype, device=DEV)
    parts = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=DEV)
    kw = {} if regs is None else {"maxnreg": regs}
    kern = D.tiles[(triton.cdiv(m, bm), n // bn, split)](
        x, w4, s4.view(torch.int32), parts, m, groups, per, x.stride(0), w4.stride(0), s4.stride(0) // 2, n, m * n,
        BM=bm, BN=bn, WAY=0, num_warps=warps, num_stages=stages, **kw)
    if ks is not None:
        ks.append(kern)
    if split > 1:
        sum_parts[(triton.cdiv(m * n, 1024),)](parts, out, m * n, SPLIT=split, BLOCK=1024, num_warps=4)
    return out

print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, time.strftime("%Y-%m-%d"), flush=True)
g = torch.Generator(device=DEV).manual_seed(6)
for rows in (1, 16):
    for label in ("q, k and v as one", "q or o", "gate and up as one", "down"):
        k, n = WIDTHS[label]
        x = torch.randn(rows, k, generator=g, device=DEV).half()
        layer = Int4Linear(torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.float16))
        w4, s4 = layer.weight_int4, layer.weight_scale
        want = x.float() @ weight_only.unpack(w4, s4).t()
        chosen = weight_only.tile_shape(rows, n, k, sms)
        turn = itertools.cycle(_copies([w4, s4]))
        base = graph_ms(lambda: weight_only.tiles(x, *next(turn), chosen))
        print(f"{rows} rows, {label}: tiles {chosen} {1e3*base:.1f} us", flush=True)
        for split, stages, regs in itertools.product((chosen[2], max(1, chosen[2] // 2)), (2, 3), (None, 96, 80, 64)):
            shape = (chosen[0], chosen[1], split, chosen[3], stages)
            ks = []
            try:
                got = run(x, w4, s4, shape, regs, ks)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                t = graph_ms(lambda: run(x, *next(turn), shape, regs))
            except Exception as e:
                print(f"   {shape} maxnreg {regs}: {type(e).__name__} {str(e)[:120]}", flush=True)
                continue
            print(f"   {1e3*t:6.1f} us ({base/t:.2f}x) split {split} stages {stages} maxnreg {regs}: regs {ks[0].n_regs} "
                  f"spills {ks[0].n_spills} err {err:.1e}", flush=True)
