"""The Triton kernel of :mod:`.quantized`: imported only where it runs (a GPU with Triton), never
at graphwrap's import."""

import triton
import triton.language as tl


@triton.jit
def rows_to_fp8(X, Q, S, sx, sq, N, FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr, TINY: tl.constexpr,
                BLOCK: tl.constexpr):
    """Row ``program_id``: its scale ``max(|x|, TINY) * INV_MAX`` (``1 / FP8_MAX`` in float32) and ``x / scale`` in E4M3, in
    fp32 and rounded once, as the torch steps it replaces."""
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(X + r * sx + c, mask=m, other=0.0).to(tl.float32)
    zero = tl.zeros([BLOCK], tl.float32)
    # (the scale as a row of equal values, times the reciprocal as torch's division by a number
    # is on a GPU; x / scale rounded as torch's division of tensors)
    s = (zero + tl.maximum(tl.max(tl.abs(x), 0), TINY)) * INV_MAX
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8_MAX), FP8_MAX)
    tl.store(Q + r * sq + c, q.to(Q.dtype.element_ty), mask=m)
    tl.store(S + r + c * 0, s, mask=c == 0)


@triton.jit
def rows_product(X, XS, W, WS, O, M, N, K, sxm, swn, som, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``O[m, n] = (X[m] . W[n]) * XS[m] * WS[n]`` for rows ``X`` and weights ``W`` in E4M3: each
    E4M3 value is exact in ``O``'s dtype (fp16, bf16), so the products are the FP8 ones, summed in
    fp32, scaled, and rounded once to ``O``'s dtype. A program takes ``BN`` outputs of ``BM`` rows
    and reads those weights once."""
    dtype = O.dtype.element_ty
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        x = tl.load(X + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(W + rn[None, :] * swn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(x.to(dtype), w.to(dtype), acc)
    xs = tl.load(XS + rm, mask=rm < M, other=0.0)
    ws = tl.load(WS + rn, mask=rn < N, other=0.0)
    out = (acc * xs[:, None] * ws[None, :]).to(dtype)
    tl.store(O + rm[:, None] * som + rn[None, :], out, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def silu_product_to_fp8(G, U, Q, S, sg, su, sq, N, FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr, TINY: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Row ``program_id`` of ``silu(G) * U`` as transformers' two kernels round it (SiLU, then the
    product, each rounded to ``G``'s dtype), then in E4M3 with its scale as :func:`rows_to_fp8`:
    the gated MLP's down projection's input, written once in FP8."""
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < N
    dtype = G.dtype.element_ty
    g = tl.load(G + r * sg + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + r * su + c, mask=m, other=0.0).to(tl.float32)
    x = ((g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * u).to(dtype).to(tl.float32)
    zero = tl.zeros([BLOCK], tl.float32)
    s = (zero + tl.maximum(tl.max(tl.abs(x), 0), TINY)) * INV_MAX
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8_MAX), FP8_MAX)
    tl.store(Q + r * sq + c, q.to(Q.dtype.element_ty), mask=m)
    tl.store(S + r + c * 0, s, mask=c == 0)
