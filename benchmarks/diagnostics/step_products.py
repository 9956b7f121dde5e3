"""A decode step's matrix products by kernel: cuBLAS's (as transformers calls them) against
graphwrap's, for the 1.1B Llama shape and a 7-8B shape, fp16, 64 and 8 rows; each timed over ten
calls in a CUDA graph (as the step's graph runs them), median of 20, with the weights' bytes
over the time (at these rows the products are bound by reading the weights):

- the gated MLP's first half, ``silu(x @ gate.T) * (x @ up.T)``: two products, SiLU and their
  product, against one kernel (``graphwrap/decoding/mlp.py``);
- the attention's query, key and value projections: three products against one kernel
  (``graphwrap/decoding/qkv.py``);
- each of them after an RMSNorm (torch's ``rms_norm``, then the products) against the kernel
  that norms its input itself (``graphwrap/decoding/layer.py``).

``python3 benchmarks/diagnostics/step_products.py [--tune]`` from the repository root, on a GPU;
``--tune`` times shapes of work of each kernel at 64 rows (outputs a program takes, the inner
dimension's step, warps, parts of the inner dimension), each checked against cuBLAS's result.
"""

import argparse
import itertools
import time

import torch
from piece_attention import graph_ms

from graphwrap.decoding import mlp, qkv

DEV = torch.device("cuda")
SHAPES = {"1.1B": (2048, 5632, (2048, 256, 256)), "7-8B": (4096, 14336, (4096, 1024, 1024))}


def _weights(g, k, ns):
    return [(torch.randn(n, k, generator=g, device=DEV) / k ** 0.5).half() for n in ns]


def _compare(label, gb, own, ours, configs):
    """cuBLAS's time, then the kernel's at each shape of work (its 12 fastest), with the largest
    difference from cuBLAS's result."""
    want = own()
    t = graph_ms(own)
    print(f"  {label}: cuBLAS (as transformers)  {t:7.4f} ms  ({gb / t:5.2f} TB/s)", flush=True)
    found = []
    for c in configs:
        kw = {} if c is None else dict(zip(("bn", "bk", "warps", "stages", "split"), c))
        try:
            got = ours(**kw)
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
            found.append((graph_ms(lambda kw=kw: ours(**kw)), c, err))
        except Exception as e:  # (a shape of work the chip's shared memory does not hold)
            print(f"  {label}: {c}: refused: {str(e).splitlines()[0][:90]}", flush=True)
    for t, c, err in sorted(found, key=lambda f: f[0])[:12]:
        name = "graphwrap's (defaults)" if c is None else "BN {} BK {} warps {} stages {} split {}".format(*c)
        print(f"  {label}: {name:38s} {t:7.4f} ms  ({gb / t:5.2f} TB/s)  max difference {err:.4f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true")
    a = ap.parse_args()
    print(f"step_products{' --tune' if a.tune else ''}: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; defaults: MLP BN {mlp.BN} BK {mlp.BK} warps {mlp.WARPS} stages "
          f"{mlp.STAGES} split {mlp.SPLIT}, projections BN {qkv.BN} BK {qkv.BK} warps {qkv.WARPS} stages {qkv.STAGES} "
          f"split {qkv.SPLIT}", flush=True)
    configs = list(itertools.product((16, 32, 64), (64, 128), (4, 8), (4,), (1, 2, 4, 8))) if a.tune else [None]
    g = torch.Generator(device=DEV).manual_seed(0)
    for name, (k, n, ns) in SHAPES.items():
        for rows in (64,) if a.tune else (64, 8):
            x = torch.randn(rows, 1, k, generator=g, device=DEV).half()
            wg, wu = _weights(g, k, (n, n))
            _compare(f"{name} {rows:2d} rows, gate and up", 2 * wg.numel() * 2 / 1e9,
                     lambda: [mlp.reference(x, wg, wu)], lambda **kw: [mlp.gate_up(x, wg, wu, **kw)], configs)
            ws = _weights(g, k, ns)
            _compare(f"{name} {rows:2d} rows, q k v", sum(w.numel() for w in ws) * 2 / 1e9,
                     lambda: qkv.reference(x, ws, [None] * 3), lambda **kw: qkv.project(x, ws, [None] * 3, **kw),
                     configs)
            if a.tune:
                continue
            norm = ((1 + 0.1 * torch.randn(k, generator=g, device=DEV)).half(), 1e-5)
            _compare(f"{name} {rows:2d} rows, RMSNorm then gate and up", 2 * wg.numel() * 2 / 1e9,
                     lambda: [mlp.reference(x, wg, wu, norm)], lambda **kw: [mlp.gate_up(x, wg, wu, norm=norm, **kw)],
                     configs)
            _compare(f"{name} {rows:2d} rows, RMSNorm then q k v", sum(w.numel() for w in ws) * 2 / 1e9,
                     lambda: qkv.reference(x, ws, [None] * 3, norm),
                     lambda **kw: qkv.project(x, ws, [None] * 3, norm=norm, **kw), configs)


if __name__ == "__main__":
    main()
