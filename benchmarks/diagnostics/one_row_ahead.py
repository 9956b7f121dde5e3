"""Whether graphwrap's one-row kernel for FP8 and int8 layers (``graphwrap.quantized.one_row``, on
the CUDA cores) is held by the bytes it keeps in flight: the same kernel with the next step's
weights loaded before this step's products (``ahead``), by shape of work, beside
``one_row`` at ``row_shape``'s shape, at the Llama-3-8B shape's widths it takes (FP8: q/k/v as
one, the output, down; int8: those and gate and up as one). Under Nsight Compute ``one_row``
kept the memory about 70% busy for the down projection and 55% for q/k/v, at half occupancy.

Ten calls in a CUDA graph over weight copies past the L2 cache, median of 20, each checked
against ``one_row``'s output. ``python3 benchmarks/diagnostics/one_row_ahead.py`` from the
repository root, on a GPU.
"""

import itertools
import time

import torch
import triton
import triton.language as tl
from fp8_products import WIDTHS, _fp8_weight, _int8_weight
from piece_attention import graph_ms
from step_products import _copies

from graphwrap.quantized import one_row, row_shape, rows_to_fp8

DEV = torch.device("cuda")
LABELS = ("q, k and v as one", "q or o", "down", "gate and up as one")


@triton.jit
def ahead(X, XS, W, WS, O, K, swn, BN: tl.constexpr, BK: tl.constexpr, HAS_XS: tl.constexpr,
          PREFETCH: tl.constexpr):
    """``graphwrap._fp8_triton.one_row`` (outputs and inputs whole multiples of the shape), with
    the next step's weights and inputs loaded before this step's products where ``PREFETCH``."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    wp = W + rn[:, None] * swn + rk[None, :]
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    w = tl.load(wp)
    x = tl.load(X + rk)
    for k0 in range(BK, K + BK, BK):
        more = k0 < K
        if PREFETCH:
            wn = tl.load(wp + k0, mask=more)
            xn = tl.load(X + k0 + rk, mask=more)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w, x = wn, xn
        else:
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w = tl.load(wp + k0, mask=more)
            x = tl.load(X + k0 + rk, mask=more)
    out = tl.sum(acc, 1)
    if HAS_XS:
        out = out * tl.load(XS)
    out = out * tl.load(WS + rn)
    tl.store(O + rn, out.to(O.dtype.element_ty))


def run(q, s, w, ws, bn, bk, warps, prefetch):
    n, k = w.shape
    out = torch.empty((1, n), dtype=torch.float16, device=DEV)
    ahead[(n // bn,)](q, ws if s is None else s, w.view(torch.int8) if s is None else w, ws, out, k, w.stride(0),
                      BN=bn, BK=bk, HAS_XS=s is not None, PREFETCH=prefetch, num_warps=warps)
    return out


def main():
    print(f"one_row_ahead: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    g = torch.Generator(device=DEV).manual_seed(5)
    shapes = list(itertools.product((4, 8), (512, 1024, 2048), (4, 8), (False, True)))
    for kind in ("fp8", "int8"):
        for label in LABELS:
            k, n = WIDTHS[label]
            chosen = row_shape(n, k, kind == "fp8")
            if chosen is None:
                continue
            x = torch.randn(1, k, generator=g, device=DEV).half()
            if kind == "fp8":
                (q, s), (w, ws) = rows_to_fp8(x), _fp8_weight(g, n, k)
            else:
                (q, s), (w, ws) = (x, None), _int8_weight(g, n, k)
            turn = itertools.cycle(_copies([w, ws]))
            want = one_row(q, s, w, ws, torch.empty((1, n), dtype=torch.float16, device=DEV), *chosen)
            base = graph_ms(lambda: one_row(q, s, *next(turn), torch.empty((1, n), dtype=torch.float16, device=DEV),
                                            *chosen))
            gb = w.numel() * w.element_size() / 1e9
            print(f"  {kind}, {label} [{k}, {n}]: one_row {chosen} {1e3 * base:.1f} us ({gb / base:.2f} TB/s)",
                  flush=True)
            found = []
            for bn, bk, warps, prefetch in shapes:
                if k % bk:
                    continue
                got = run(q, s, w, ws, bn, bk, warps, prefetch)
                err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                t = graph_ms(lambda: run(q, s, *next(turn), bn, bk, warps, prefetch))
                found.append((t, (bn, bk, warps, prefetch), err))
            found.sort(key=lambda f: f[0])
            for t, shape, err in found[:4]:
                print(f"    {1e3 * t:6.1f} us ({gb / t:.2f} TB/s, {base / t:.2f}x) (bn, bk, warps, ahead) {shape}, "
                      f"largest difference {err:.1e}", flush=True)
            same = [f for f in found if f[1][:3] == chosen and not f[1][3]]
            if same:
                print(f"    this kernel at one_row's shape, not ahead: {1e3 * same[0][0]:.1f} us", flush=True)


if __name__ == "__main__":
    main()
