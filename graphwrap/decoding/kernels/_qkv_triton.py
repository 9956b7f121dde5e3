"""The Triton kernel of :mod:`.qkv`: imported only where it runs (a GPU with Triton), never at
graphwrap's import."""

import triton
import triton.language as tl


@triton.jit
def _tile(X, W, B, O, P, n0, c0, s, M, N, K, KS, sxm, swn, som, spm, sps, HAS_BIAS: tl.constexpr,
          SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``O[:, n0:n0 + BN] = X @ W[n0:n0 + BN].T (+ B)``, summed in fp32 and rounded once; with
    ``SPLIT`` > 1, the sum over the inner dimension's ``s``-th part of ``KS`` goes unrounded to
    ``P[s, :, c0 + n0:]`` (its columns in the three products side by side) for ``reduce``."""
    rn = n0 + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(s * KS, s * KS + KS, BK):
        kk = k0 + rk
        x = tl.load(X + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(W + rn[None, :] * swn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc)
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(O + rm[:, None] * som + rn[None, :], acc.to(O.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))
    else:
        tl.store(P + s * sps + rm[:, None] * spm + (c0 + rn)[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def project(X, W0, W1, W2, B0, B1, B2, O0, O1, O2, P, M, N0, N1, N2, K, KS, sxm, sw0, sw1, sw2, so0, so1, so2, spm,
            sps, T0, T1, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr):
    t = tl.program_id(0)  # tiles of the first product's outputs, then the second's, then the third's
    s = tl.program_id(1)  # the part of the inner dimension (SPLIT > 1)
    if t < T0:
        _tile(X, W0, B0, O0, P, t * BN, 0, s, M, N0, K, KS, sxm, sw0, so0, spm, sps, HAS_BIAS, SPLIT, BM, BN, BK)
    elif t < T0 + T1:
        _tile(X, W1, B1, O1, P, (t - T0) * BN, N0, s, M, N1, K, KS, sxm, sw1, so1, spm, sps, HAS_BIAS, SPLIT, BM,
              BN, BK)
    else:
        _tile(X, W2, B2, O2, P, (t - T0 - T1) * BN, N0 + N1, s, M, N2, K, KS, sxm, sw2, so2, spm, sps, HAS_BIAS,
              SPLIT, BM, BN, BK)


@triton.jit
def reduce(P, B0, B1, B2, O0, O1, O2, N0, N1, N2, so0, so1, so2, spm, sps, HAS_BIAS: tl.constexpr,
           SPLIT: tl.constexpr, BN: tl.constexpr):
    """Row ``m``'s sums of ``project``'s ``SPLIT`` parts, in their order, (+ the bias) rounded once
    into the three outputs."""
    m = tl.program_id(0)
    c = tl.program_id(1) * BN + tl.arange(0, BN)
    nt = N0 + N1 + N2
    acc = tl.zeros((BN,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(P + s * sps + m * spm + c, mask=c < nt, other=0.0)
    in0 = c < N0
    in1 = (c >= N0) & (c < N0 + N1)
    in2 = (c >= N0 + N1) & (c < nt)
    if HAS_BIAS:
        acc += tl.load(B0 + c, mask=in0, other=0.0).to(tl.float32)
        acc += tl.load(B1 + (c - N0), mask=in1, other=0.0).to(tl.float32)
        acc += tl.load(B2 + (c - N0 - N1), mask=in2, other=0.0).to(tl.float32)
    dtype = O0.dtype.element_ty
    tl.store(O0 + m * so0 + c, acc.to(dtype), mask=in0)
    tl.store(O1 + m * so1 + (c - N0), acc.to(dtype), mask=in1)
    tl.store(O2 + m * so2 + (c - N0 - N1), acc.to(dtype), mask=in2)
