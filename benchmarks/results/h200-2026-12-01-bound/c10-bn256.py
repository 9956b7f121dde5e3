"""int4 tiles at one and 16 rows with 256 outputs a program (not in the earlier tune) beside the rule."""
import itertools
import sys
import time

sys.path.insert(0, "benchmarks/diagnostics")
import torch
import triton
from fp8_products import WIDTHS
from piece_attention import graph_ms
from step_products import _copies

from graphwrap import weight_only
from graphwrap.quantized import Int4Linear

DEV = torch.device("cuda")
sms = torch.cuda.get_device_properties(DEV).multi_processor_count
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, time.strftime("%Y-%m-%d"), flush=True)
g = torch.Generator(device=DEV).manual_seed(7)
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
        found = []
        for split, warps, stages in itertools.product((2, 4, 8, 16), (4, 8), (2, 3, 4)):
            shape = (16, 256, split, warps, stages)
            try:
                got = weight_only.tiles(x, w4, s4, shape)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                t = graph_ms(lambda: weight_only.tiles(x, *next(turn), shape))
            except Exception as e:
                print(f"   {shape}: {type(e).__name__} {str(e)[:100]}", flush=True)
                continue
            found.append((t, shape, err))
        found.sort()
        print(f"{rows} rows, {label}: rule {chosen} {1e3*base:.1f} us; 256 outputs a program, fastest:", flush=True)
        for t, shape, err in found[:3]:
            print(f"   {1e3*t:6.1f} us ({base/t:.2f}x) {shape} err {err:.1e}", flush=True)
