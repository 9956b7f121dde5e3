"""A decode step's RMSNorm by kernel: PyTorch's fused ``rms_norm`` (what the batch ran before)
against graphwrap's (``graphwrap/decoding/kernels/norm.py``), at the widths of the 1.1B Llama shape
(2,048) and a 7-8B shape (4,096), fp16, 64 and 8 rows; each timed over ten calls in a CUDA
graph (as the step's graph runs them), median of 20, with the largest difference from the fp32
reference. ``--tune`` times 1, 2, 4, 8 and 16 warps too.

``python3 benchmarks/diagnostics/step_norm.py [--tune]`` from the repository root, on a GPU.
"""

import argparse
import time

import torch
from piece_attention import graph_ms
from torch.nn import functional as F

from graphwrap.decoding.kernels import norm

DEV = torch.device("cuda")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true")
    a = ap.parse_args()
    print(f"step_norm: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}",
          flush=True)
    g = torch.Generator(device=DEV).manual_seed(0)
    for width in (2048, 4096):
        for rows in (64, 8):
            x = torch.randn(rows, 1, width, generator=g, device=DEV).half()
            w = (1 + 0.1 * torch.randn(width, generator=g, device=DEV)).half()
            want = norm.reference(x, w, 1e-5)
            label = f"{width} wide, {rows:2d} rows"
            t = graph_ms(lambda: F.rms_norm(x, (width,), w, 1e-5))
            err = (F.rms_norm(x, (width,), w, 1e-5).float() - want.float()).abs().max().item()
            print(f"  {label}: PyTorch's rms_norm   {1e3 * t:6.2f} us  max difference {err:.4f}", flush=True)
            for warps in (0, 1, 2, 4, 8, 16) if a.tune else (0,):
                t = graph_ms(lambda warps=warps: norm.rms(x, w, 1e-5, warps))
                err = (norm.rms(x, w, 1e-5, warps).float() - want.float()).abs().max().item()
                name = "graphwrap's (defaults)" if not warps else f"graphwrap's, {warps} warps"
                print(f"  {label}: {name:22s} {1e3 * t:6.2f} us  max difference {err:.4f}", flush=True)


if __name__ == "__main__":
    main()
