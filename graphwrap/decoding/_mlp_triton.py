"""The Triton kernel of :mod:`.mlp`: imported only where it runs (a GPU with Triton), never at
graphwrap's import."""

import triton
import triton.language as tl

from ._qkv_triton import normed, rstd


@triton.jit
def _silu_mul(g, u, dtype):
    """``silu(g) * u`` of fp32 sums, each step rounded to ``dtype`` as transformers' kernels round."""
    g = g.to(dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (s * u.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def gate_up(X, WG, WU, O, P, NW, EPS, M, N, K, KS, sxm, swn, som, spm, sps, HAS_NORM: tl.constexpr,
            SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``O[m, n] = silu(X[m] . WG[n]) * (X[m] . WU[n])``, each product rounded to ``O``'s dtype
    before the next operation, as transformers' three kernels round. With ``SPLIT`` > 1, program
    ``(.., .., s)`` sums the inner dimension's ``s``-th part of ``KS`` into ``P[s, :, n]`` (gate)
    and ``P[s, :, N + n]`` (up), unrounded, for ``finish``. With ``HAS_NORM``, ``X`` is first
    normed as an RMSNorm of weight ``NW`` would."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    s = tl.program_id(2)
    rk = tl.arange(0, BK)
    if HAS_NORM:
        r = rstd(X, rm, M, K, sxm, EPS, BM, BK)
    g = tl.zeros((BM, BN), dtype=tl.float32)
    u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(s * KS, s * KS + KS, BK):
        kk = k0 + rk
        x = tl.load(X + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        if HAS_NORM:
            x = normed(x, r, NW, kk, K)
        wm = (rn[None, :] < N) & (kk[:, None] < K)
        at = rn[None, :] * swn + kk[:, None]  # the weights' [BK, BN] tile: W[n, k] at n * swn + k
        g = tl.dot(x, tl.load(WG + at, mask=wm, other=0.0), g)
        u = tl.dot(x, tl.load(WU + at, mask=wm, other=0.0), u)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT == 1:
        tl.store(O + rm[:, None] * som + rn[None, :], _silu_mul(g, u, O.dtype.element_ty), mask=mask)
    else:
        at = P + s * sps + rm[:, None] * spm + rn[None, :]
        tl.store(at, g, mask=mask)
        tl.store(at + N, u, mask=mask)


@triton.jit
def finish(P, O, N, som, spm, sps, SPLIT: tl.constexpr, BN: tl.constexpr):
    """Row ``m``'s sums of ``gate_up``'s ``SPLIT`` parts, in their order, then SiLU and the product."""
    m = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    g = tl.zeros((BN,), dtype=tl.float32)
    u = tl.zeros((BN,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        g += tl.load(P + s * sps + m * spm + n, mask=n < N, other=0.0)
        u += tl.load(P + s * sps + m * spm + N + n, mask=n < N, other=0.0)
    tl.store(O + m * som + n, _silu_mul(g, u, O.dtype.element_ty), mask=n < N)
