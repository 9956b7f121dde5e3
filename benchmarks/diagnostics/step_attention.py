"""A decode step's attention by shape of work: graphwrap's paged kernel (``paged_attention.py``)
over 64 rows of the 1.1B Llama shape (32 query heads over 4, 64 wide) and a 7-8B shape (32 over
8, 128 wide), fp16, each row at ``S`` positions of a scattered paged pool; each timed over ten
calls in a CUDA graph (as the step's graph runs it), median of 20, with the keys' and values'
bytes over the time, and checked against the torch reference. With ``--kv fp8``, the pools are
FP8 (graphwrap/decoding/cache/fp8.py), read back with their scales; ``--rows`` sets the rows.

``python3 benchmarks/diagnostics/step_attention.py [--tune] [--kv fp8] [--rows 256] [--shape 7-8B]
[--positions 192,1024,4096] [--splits] [--long 8192]`` from the repository root, on a GPU; without ``--tune`` only
the defaults; with it, every tile of positions, warps and pipeline stages, the 12 fastest of each
case; with ``--splits``, the default shape with each row's positions split between 1 to 16
programs, and 16 balanced by the step's work (``paged_attention.work_of``: what a window past
1,024 positions takes), and the split ``paged_attention.splits_at`` takes there; with ``--long
P``, the first row at ``P`` positions (one long row beside the others).
"""

import argparse
import itertools
import time

import torch
from piece_attention import graph_ms

from graphwrap.decoding.cache import fp8
from graphwrap.decoding.kernels import paged_attention

DEV = torch.device("cuda")
SHAPES = {"1.1B": (32, 4, 64), "7-8B": (32, 8, 128)}
ROWS, BLOCK = 64, 16


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--kv", default="fp16", choices=("fp16", "fp8", "fp8k", "fp8v"),
                    help="the pools' dtype (fp8k, fp8v: only the keys', only the values' pool FP8)")
    ap.add_argument("--rows", type=int, default=ROWS)
    ap.add_argument("--shape", default=None, choices=tuple(SHAPES))
    ap.add_argument("--positions", default="192,1024,4096", help="each row's positions, comma-separated")
    ap.add_argument("--splits", action="store_true",
                    help="the default shape at 1, 2, 4, 8 and 16 programs a row, 16 balanced (and what splits_at takes)")
    ap.add_argument("--long", type=int, default=0, help="the first row's positions (0: as the others')")
    a = ap.parse_args()
    rows = a.rows
    scales = fp8.Scales(0.02, 0.01) if a.kv != "fp16" else None
    print(f"step_attention{' --tune' if a.tune else ''}: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; {rows} rows, pools {a.kv}; defaults: (tile, warps, stages) "
          f"{paged_attention.shape_of_work(64)} for 64-wide heads, {paged_attention.shape_of_work(128)} for 128", flush=True)
    configs = list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3))) if a.tune else [None]
    if a.splits:
        configs = [("splits", s) for s in (1, 2, 4, 8, 16)] + [("balanced", paged_attention.SPLITS)]
    g = torch.Generator(device=DEV).manual_seed(0)
    for name, (hq, hkv, d) in SHAPES.items():
        if a.shape not in (None, name):
            continue
        for S in map(int, a.positions.split(",")):
            lines = max(S, a.long) // BLOCK
            blocks = rows * lines + 1
            k_pool = torch.randn(blocks, BLOCK, hkv, d, generator=g, device=DEV).half()
            v_pool = torch.randn(blocks, BLOCK, hkv, d, generator=g, device=DEV).half()
            ks, vs = 1.0, 1.0
            if scales is not None:
                if a.kv in ("fp8", "fp8k"):
                    k_pool, ks = fp8.encode(k_pool, scales.keys), scales.keys
                if a.kv in ("fp8", "fp8v"):
                    v_pool, vs = fp8.encode(v_pool, scales.values), scales.values
            table = (torch.randperm(blocks - 1, generator=g, device=DEV)[:rows * lines] + 1).view(rows, lines)
            lengths = torch.full((rows,), S, device=DEV)
            lengths[0] = a.long or S
            work = paged_attention.work_of(lengths, d)
            q = torch.randn(rows, hq, 1, d, generator=g, device=DEV).half()
            want = paged_attention.reference(q, k_pool, v_pool, table, lengths, d ** -0.5, None, None, ks, vs)
            gb = int(lengths.sum()) * hkv * d * (k_pool.element_size() + v_pool.element_size()) / 1e9
            found = []
            for c in configs:
                kw = ({} if c is None else {c[0]: c[1]} if c[0] == "splits" else dict(splits=c[1], work=work)
                      if c[0] == "balanced" else dict(zip(("tile", "warps", "stages"), c)))

                def f(kw=kw):
                    return paged_attention._launch(q[:, :, 0], k_pool, v_pool, table, lengths, d ** -0.5, 0, 0.0,
                                                   k_scale=ks, v_scale=vs, **kw)
                try:
                    err = (f()[:, None].float() - want.float()).abs().max().item()
                    found.append((graph_ms(f), c, err))
                except Exception as e:  # (a shape of work the chip's shared memory does not hold)
                    print(f"  {name} S={S}: {c}: refused: {str(e).splitlines()[0][:90]}", flush=True)
            if a.splits:
                print(f"  {name} S={S:5d}: splits_at takes "
                      f"{paged_attention.splits_at(paged_attention.splits_for(S), rows, hkv, DEV)}", flush=True)
            for t, c, err in sorted(found, key=lambda x: x[0])[:12]:
                label = ("defaults" if c is None else f"splits {c[1]}" if c[0] == "splits" else f"splits {c[1]}, balanced"
                         if c[0] == "balanced"
                         else "tile {} warps {} stages {}".format(*c))
                print(f"  {name} S={S:5d}: {label:28s} {t:7.4f} ms  ({gb / t:5.2f} TB/s)  max error {err:.4f}",
                      flush=True)


if __name__ == "__main__":
    main()
