"""A decode step's gated MLP first half, ``silu(x @ gate.T) * (x @ up.T)``, by kernel: cuBLAS's two
products with PyTorch's SiLU and product (transformers' four kernels) against graphwrap's one
(``graphwrap/decoding/mlp.py``), for the 1.1B Llama shape (2,048 -> 5,632) and a 7-8B shape
(4,096 -> 14,336), fp16, 64 and 8 rows; each timed over ten calls in a CUDA graph (as the step's
graph runs them), median of 20, with the bytes of both weights over the time (the products are
bound by reading the weights at these rows).

``python3 benchmarks/diagnostics/mlp_kernel.py [--tune]`` from the repository root, on a GPU;
``--tune`` times every shape of work of the kernel (outputs a program takes, the inner
dimension's step, warps, pipeline stages), each checked against transformers' operations.
"""

import argparse
import itertools
import time

import torch
from piece_attention import graph_ms

from graphwrap.decoding import mlp

DEV = torch.device("cuda")
SHAPES = {"1.1B": (2048, 5632), "7-8B": (4096, 14336)}


def _inputs(rows, k, n):
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(rows, 1, k, generator=g, device=DEV).half()
    wg = (torch.randn(n, k, generator=g, device=DEV) / k ** 0.5).half()
    wu = (torch.randn(n, k, generator=g, device=DEV) / k ** 0.5).half()
    return x, wg, wu


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true")
    a = ap.parse_args()
    print(f"mlp_kernel{' --tune' if a.tune else ''}: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; defaults BN {mlp.BN} BK {mlp.BK} warps {mlp.WARPS} stages {mlp.STAGES}",
          flush=True)
    configs = list(itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4))) if a.tune else [None]
    for name, (k, n) in SHAPES.items():
        for rows in (64, 8):
            x, wg, wu = _inputs(rows, k, n)
            gb = 2 * wg.numel() * wg.element_size() / 1e9
            own = mlp.reference(x, wg, wu)
            t = graph_ms(lambda: mlp.reference(x, wg, wu))
            print(f"  {name} {rows:2d} rows: cuBLAS, SiLU, product  {t:7.4f} ms  ({gb / t:5.2f} TB/s)", flush=True)
            found = []
            for c in configs:
                kw = {} if c is None else dict(zip(("bn", "bk", "warps", "stages"), c))
                try:
                    err = (mlp.gate_up(x, wg, wu, **kw).float() - own.float()).abs().max().item()
                    found.append((graph_ms(lambda kw=kw: mlp.gate_up(x, wg, wu, **kw)), c, err))
                except Exception as e:  # (a shape of work the chip's shared memory does not hold)
                    print(f"  {name} {rows:2d} rows: {c}: refused: {str(e).splitlines()[0][:90]}", flush=True)
            for t, c, err in sorted(found, key=lambda f: f[0])[:12]:
                label = "the kernel (defaults)" if c is None else "BN {} BK {} warps {} stages {}".format(*c)
                print(f"  {name} {rows:2d} rows: {label:30s} {t:7.4f} ms  ({gb / t:5.2f} TB/s)  max difference "
                      f"{err:.4f}", flush=True)


if __name__ == "__main__":
    main()
