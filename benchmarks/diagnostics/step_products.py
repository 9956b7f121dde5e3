"""A decode step's matrix products by kernel: cuBLAS's (as transformers calls them) against
graphwrap's, for the 1.1B Llama shape and a 7-8B shape, fp16, 64 and 8 rows; each timed over ten
calls in a CUDA graph (as the step's graph runs them), median of 20, with the weights' bytes
over the time (at these rows the products are bound by reading the weights):

- the gated MLP's first half, ``silu(x @ gate.T) * (x @ up.T)``: two products, SiLU and their
  product, against one kernel (``graphwrap/decoding/kernels/mlp.py``);
- the attention's query, key and value projections: three products against one kernel
  (``graphwrap/decoding/kernels/qkv.py``);
- the attention's output projection and the MLP's down projection, one product each, against
  the same kernel with one product (``--tune`` only).

Each call reads its own copy of the weights, enough copies that they do not fit the chip's L2
cache together (as in a step, where each layer reads its own weights once).

``python3 benchmarks/diagnostics/step_products.py [--tune] [--kinds gate,qkv,o,down]`` from the
repository root, on a GPU; ``--tune`` times shapes of work of each kernel at 64 rows (outputs a
program takes, the inner dimension's step, warps; for the projections, parts of the inner
dimension), each checked against cuBLAS's result.
"""

import argparse
import itertools
import time
from typing import List

import torch
from piece_attention import graph_ms

from graphwrap.decoding.kernels import mlp, qkv

DEV = torch.device("cuda")
SHAPES = {"1.1B": (2048, 5632, (2048, 256, 256)), "7-8B": (4096, 14336, (4096, 1024, 1024))}


def _weights(g, k, ns):
    return [(torch.randn(n, k, generator=g, device=DEV) / k ** 0.5).half() for n in ns]


def _copies(weights: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """``weights`` and copies of them, as many as make twice the L2 cache's bytes (a step's layers
    each read their own weights once; ten calls of one copy would read the cache)."""
    size = sum(w.numel() * w.element_size() for w in weights)
    l2 = getattr(torch.cuda.get_device_properties(DEV), "L2_cache_size", 50 << 20)
    return [weights] + [[w.clone() for w in weights] for _ in range(-(-2 * l2 // size) - 1)]


def _compare(label, gb, own, ours, weights, configs):
    """cuBLAS's time, then the kernel's at each shape of work (its 12 fastest), with the largest
    difference from cuBLAS's result (``own(ws)``, ``ours(ws, **shape)``: the products over
    ``weights``, each call of a graph over the next copy)."""
    copies = _copies(weights)
    turn = itertools.cycle(copies)
    want = own(weights)
    t = graph_ms(lambda: own(next(turn)))
    print(f"  {label}: cuBLAS (as transformers)  {t:7.4f} ms  ({gb / t:5.2f} TB/s)", flush=True)
    found = []
    for c in configs:
        kw = {} if c is None else dict(zip(("bn", "bk", "warps", "stages", "split"), c))
        try:
            got = ours(weights, **kw)
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
            found.append((graph_ms(lambda kw=kw: ours(next(turn), **kw)), c, err))
        except Exception as e:  # (a shape of work the chip's shared memory does not hold)
            print(f"  {label}: {c}: refused: {str(e).splitlines()[0][:90]}", flush=True)
    for t, c, err in sorted(found, key=lambda f: f[0])[:12]:
        name = "graphwrap's (defaults)" if c is None else " ".join(f"{n} {v}" for n, v in zip(("BN", "BK", "warps", "stages", "split"), c))
        print(f"  {label}: {name:38s} {t:7.4f} ms  ({gb / t:5.2f} TB/s)  max difference {err:.4f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--kinds", default="gate,qkv,o,down", help="which products (o and down: --tune only)")
    a = ap.parse_args()
    print(f"step_products{' --tune' if a.tune else ''}: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; defaults: MLP (BN, BK, warps) {mlp.shape_of_work(5632, DEV)} (1.1B), "
          f"{mlp.shape_of_work(14336, DEV)} (7-8B) stages {mlp.STAGES}, projections BN {qkv.BN} BK {qkv.BK} warps {qkv.WARPS} stages {qkv.STAGES} split "
          f"{qkv.SPLIT or 'by the tiles'}", flush=True)
    configs = list(itertools.product((16, 32, 64, 128), (64, 128), (4, 8), (4,))) if a.tune else [None]
    splits = [c + (s,) for c in configs for s in (1, 2, 4)] if a.tune else [None]
    g = torch.Generator(device=DEV).manual_seed(0)
    for name, (k, n, ns) in SHAPES.items():
        for rows in (64,) if a.tune else (64, 8):
            x = torch.randn(rows, 1, k, generator=g, device=DEV).half()
            if "gate" in a.kinds:
                _compare(f"{name} {rows:2d} rows, gate and up", 2 * n * k * 2 / 1e9,
                         lambda ws: [mlp.reference(x, *ws)], lambda ws, **kw: [mlp.gate_up(x, *ws, **kw)],
                         _weights(g, k, (n, n)), configs)
            if "qkv" in a.kinds:
                _compare(f"{name} {rows:2d} rows, q k v", sum(ns) * k * 2 / 1e9,
                         lambda ws: qkv.reference(x, ws, [None] * 3),
                         lambda ws, **kw: qkv.project(x, ws, [None] * 3, **kw), _weights(g, k, ns), splits)
            for kind, (kk, nn) in (("o", (k, k)), ("down", (n, k))):
                if kind in a.kinds and a.tune:
                    xk = torch.randn(rows, 1, kk, generator=g, device=DEV).half()
                    _compare(f"{name} {rows:2d} rows, {kind}", nn * kk * 2 / 1e9,
                             lambda ws, xk=xk: qkv.reference(xk, ws, [None]),
                             lambda ws, xk=xk, **kw: qkv.project(xk, ws, [None], **kw),
                             _weights(g, kk, (nn,)), [c + (s,) for c in configs for s in (1, 2, 4, 8)])


if __name__ == "__main__":
    main()
