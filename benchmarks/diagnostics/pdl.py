"""What programmatic dependent launch gives a chain of small Triton kernels in a CUDA graph: each
kernel reads the last one's output (one row of 4,096 values, or a product-sized grid of
``--programs`` programs each reading a 16 KB slice), launched plainly or with
``launch_pdl=True`` and ``griddepcontrol.wait`` first (the kernel may start while the last one
finishes, and waits for it before any read or write). Per kernel, median of 20 replays of a
graph of ``--chain`` kernels.

``python3 benchmarks/diagnostics/pdl.py`` from the repository root, on a Hopper GPU with Triton
3.3 or later.
"""

import argparse
import time

import torch
import triton
import triton.language as tl
from piece_attention import ms
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def step(X, Y, N, PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        gdc_wait()
    if EARLY:
        gdc_launch_dependents()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + i, mask=i < N, other=0.0)
    tl.store(Y + i, x * 0.5 + 1.0, mask=i < N)


def chain_ms(programs: int, block: int, chain: int, pdl: bool, early: bool) -> float:
    n = programs * block
    a = torch.zeros(n, device="cuda")
    b = torch.zeros(n, device="cuda")

    def run():
        for i in range(chain):
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            step[(programs,)](src, dst, n, PDL=pdl, EARLY=early, BLOCK=block, num_warps=4, launch_pdl=pdl)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    want = torch.zeros(n, device="cuda")
    for _ in range(chain):
        want = want * 0.5 + 1.0
    assert torch.allclose(a if chain % 2 == 0 else b, want), "a kernel read its input before the last one wrote it"
    return ms(graph.replay) / chain


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chain", type=int, default=200)
    a = ap.parse_args()
    print(f"pdl: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; a chain of {a.chain} kernels in a graph, us a kernel", flush=True)
    for programs, block in ((1, 4096), (32, 1024), (132, 1024), (1536, 1024), (8192, 1024)):
        plain = chain_ms(programs, block, a.chain, False, False)
        pdl = chain_ms(programs, block, a.chain, True, False)
        early = chain_ms(programs, block, a.chain, True, True)
        print(f"  {programs:5d} programs of {block}: plain {1e3 * plain:6.2f}; with PDL {1e3 * pdl:6.2f} "
              f"({plain / pdl:.2f}x); with PDL, dependents launched at once {1e3 * early:6.2f} ({plain / early:.2f}x)",
              flush=True)


if __name__ == "__main__":
    main()
