"""The Triton kernel of :mod:`.qkv`: imported only where it runs (a GPU with Triton), never at
graphwrap's import."""

import triton
import triton.language as tl


@triton.jit
def _tile(X, W, B, O, n0, M, N, K, sxm, swn, som, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr):
    """``O[:, n0:n0 + BN] = X @ W[n0:n0 + BN].T (+ B)``, summed in fp32 and rounded once."""
    rn = n0 + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        x = tl.load(X + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(W + rn[None, :] * swn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(O + rm[:, None] * som + rn[None, :], acc.to(O.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def project(X, W0, W1, W2, B0, B1, B2, O0, O1, O2, M, N0, N1, N2, K, sxm, sw0, sw1, sw2, so0, so1, so2, T0, T1,
            HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0)  # tiles of the first product's outputs, then the second's, then the third's
    if t < T0:
        _tile(X, W0, B0, O0, t * BN, M, N0, K, sxm, sw0, so0, HAS_BIAS, BM, BN, BK)
    elif t < T0 + T1:
        _tile(X, W1, B1, O1, (t - T0) * BN, M, N1, K, sxm, sw1, so1, HAS_BIAS, BM, BN, BK)
    else:
        _tile(X, W2, B2, O2, (t - T0 - T1) * BN, M, N2, K, sxm, sw2, so2, HAS_BIAS, BM, BN, BK)
