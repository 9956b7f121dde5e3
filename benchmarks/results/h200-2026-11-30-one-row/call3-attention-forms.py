"""Scratch: the step's paged attention at few rows, split or not, by tile and warps."""
import itertools
import sys

import torch

sys.path.insert(0, "benchmarks/diagnostics")
from piece_attention import graph_ms

from graphwrap.decoding.kernels import paged_attention

DEV = torch.device("cuda")
BLOCK = 16
print(f"att1: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
hq, hkv, d = 32, 8, 128
g = torch.Generator(device=DEV).manual_seed(0)
for rows in (1, 4, 16):
    for S in (128, 256, 512, 1024, 4096):
        lines = S // BLOCK
        blocks = rows * lines + 1
        k_pool = torch.randn(blocks, BLOCK, hkv, d, generator=g, device=DEV).half()
        v_pool = torch.randn(blocks, BLOCK, hkv, d, generator=g, device=DEV).half()
        table = (torch.randperm(blocks - 1, generator=g, device=DEV)[:rows * lines] + 1).view(rows, lines)
        lengths = torch.full((rows,), S, device=DEV)
        q = torch.randn(rows, hq, 1, d, generator=g, device=DEV).half()
        want = paged_attention.reference(q, k_pool, v_pool, table, lengths, d ** -0.5, None, None)
        found = []
        for tile, warps, splits in itertools.product((16, 32, 64), (1, 2, 4), (1, 2, 4, 8, 16, 32)):
            if splits > 1 and S // tile < splits // 2:
                continue
            f = lambda: paged_attention._launch(q[:, :, 0], k_pool, v_pool, table, lengths, d ** -0.5, 0, 0.0,
                                                tile=tile, warps=warps, stages=2, splits=splits)
            try:
                err = (f()[:, None].float() - want.float()).abs().max().item()
                found.append((graph_ms(f), (tile, warps, splits), err))
            except Exception as e:
                print(f"  {rows} rows S={S}: {tile, warps, splits}: {type(e).__name__} {str(e)[:80]}", flush=True)
        dflt = graph_ms(lambda: paged_attention._launch(q[:, :, 0], k_pool, v_pool, table, lengths, d ** -0.5, 0, 0.0,
                                                         splits=paged_attention.splits_for(S)))
        found.sort(key=lambda x: x[0])
        print(f"{rows} rows S={S}: default {1e3*dflt:.2f} us; fastest:", flush=True)
        for t, c, err in found[:6]:
            print(f"   {1e3*t:6.2f} us tile {c[0]} warps {c[1]} splits {c[2]} err {err:.4f}", flush=True)
        for t, c, err in found:
            if c == (64, 2, 1):
                print(f"   (tile 64 warps 2 splits 1: {1e3*t:.2f} us)", flush=True)
