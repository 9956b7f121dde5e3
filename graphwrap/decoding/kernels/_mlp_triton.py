"""The Triton kernel of :mod:`.mlp`: imported only where it runs (a GPU with Triton), never at
graphwrap's import."""

import triton
import triton.language as tl


@triton.jit
def gate_up(X, WG, WU, O, M, N, K, sxm, swn, som, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``O[m, n] = silu(X[m] . WG[n]) * (X[m] . WU[n])``, each product rounded to ``O``'s dtype
    before the next operation, as transformers' three kernels round."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    g = tl.zeros((BM, BN), dtype=tl.float32)
    u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        x = tl.load(X + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        wm = (rn[None, :] < N) & (kk[:, None] < K)
        at = rn[None, :] * swn + kk[:, None]  # the weights' [BK, BN] tile: W[n, k] at n * swn + k
        g = tl.dot(x, tl.load(WG + at, mask=wm, other=0.0), g)
        u = tl.dot(x, tl.load(WU + at, mask=wm, other=0.0), u)
    dtype = O.dtype.element_ty
    g = g.to(dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    out = (s * u.to(dtype).to(tl.float32)).to(dtype)
    tl.store(O + rm[:, None] * som + rn[None, :], out, mask=(rm[:, None] < M) & (rn[None, :] < N))
