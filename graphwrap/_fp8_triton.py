"""The Triton kernels of :mod:`.quantized` and :mod:`.quantized`'s int8 layers: imported only
where they run (a GPU with Triton), never at graphwrap's import."""

import triton
import triton.language as tl


@triton.jit
def _store_fp8(x, Q, S, r, sq, c, m, FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr, TINY: tl.constexpr,
               BLOCK: tl.constexpr):
    """Row ``r`` ``x`` (fp32, ``BLOCK`` wide, ``m`` its columns) in E4M3 at ``Q`` and its scale at
    ``S``: the scale ``max(|x|, TINY) * INV_MAX`` (``1 / FP8_MAX`` in float32), ``x / scale`` rounded
    once, as the torch steps it replaces (``rows_to_fp8_reference``)."""
    zero = tl.zeros([BLOCK], tl.float32)
    # (the scale as a row of equal values, times the reciprocal as torch's division by a number
    # is on a GPU; x / scale rounded as torch's division of tensors)
    s = (zero + tl.maximum(tl.max(tl.abs(x), 0), TINY)) * INV_MAX
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8_MAX), FP8_MAX)
    tl.store(Q + r * sq + c, q.to(Q.dtype.element_ty), mask=m)
    tl.store(S + r + c * 0, s, mask=c == 0)


@triton.jit
def rows_to_fp8(X, Q, S, sx, sq, N, FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr, TINY: tl.constexpr,
                BLOCK: tl.constexpr):
    """Row ``program_id`` in E4M3 with its scale (:func:`_store_fp8`)."""
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(X + r * sx + c, mask=m, other=0.0).to(tl.float32)
    _store_fp8(x, Q, S, r, sq, c, m, FP8_MAX, INV_MAX, TINY, BLOCK)


@triton.jit
def rms_norm_to_fp8(X, W, O, Q, S, sx, so, sq, N, eps, FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr,
                    TINY: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``program_id`` of RMSNorm, ``x * rsqrt(mean(x^2) + eps) * w`` in fp32 rounded once to
    ``O``'s dtype, as graphwrap's norm kernel (``decoding/kernels/_norm_triton.py``), written at
    ``O`` and, from that rounded row, in E4M3 with its scale (:func:`_store_fp8`)."""
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(X + r * sx + c, mask=m, other=0.0).to(tl.float32)
    w = tl.load(W + c, mask=m, other=0.0).to(tl.float32)
    v = tl.sum(x * x, 0) / N
    y = (x * tl.rsqrt(v + eps) * w).to(O.dtype.element_ty)
    tl.store(O + r * so + c, y, mask=m)
    _store_fp8(y.to(tl.float32), Q, S, r, sq, c, m, FP8_MAX, INV_MAX, TINY, BLOCK)


@triton.jit
def rows_product(X, XS, W, WS, O, M, N, K, sxm, swn, som, sop, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 SPLIT: tl.constexpr, HAS_XS: tl.constexpr, BF16: tl.constexpr):
    """``O[m, n] = (X[m] . W[n]) * XS[m] * WS[n]``: rows ``X`` and weights ``W`` in E4M3 (FP8
    layers), or rows in fp16 or bf16 without scales (``HAS_XS`` false) and weights in int8 read
    as their bytes (int8 weight-only layers; made fp16 by their bits, not by a conversion of
    each). Each E4M3 value is exact in fp16 and each int8 value in fp16 and bf16,
    so the products are the layer's own, summed in fp32 (in bf16 where ``BF16``: the rows' dtype),
    scaled, and rounded once to ``O``'s dtype. A program takes ``BN`` outputs of ``BM`` rows and
    reads those weights once. With ``SPLIT`` > 1 it takes the ``program_id(2)``-th of as many
    parts of the inner dimension and writes its sum, scaled, in fp32 to ``O``'s part
    ``program_id(2)`` (``sop`` apart), for :func:`sum_parts`."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    per = tl.cdiv(K, SPLIT * BK) * BK
    start = tl.program_id(2) * per
    for k0 in range(start, tl.minimum(start + per, K), BK):
        kk = k0 + rk
        x = tl.load(X + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(W + rn[None, :] * swn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if HAS_XS:
            acc = tl.dot(x.to(tl.float16), w.to(tl.float16), acc)
        else:  # (int8 weights, read as bytes: each in fp16 as 1152 + w under 0x6400's exponent, less 1152)
            h = ((w ^ 0x80).to(tl.uint16) | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)
            w16 = (h - 1152.0).to(tl.float16)
            if BF16:
                acc = tl.dot(x.to(tl.bfloat16), w16.to(tl.bfloat16), acc)
            else:
                acc = tl.dot(x.to(tl.float16), w16, acc)
    ws = tl.load(WS + rn, mask=rn < N, other=0.0)
    if HAS_XS:
        xs = tl.load(XS + rm, mask=rm < M, other=0.0)
        acc = acc * xs[:, None]
    out = (acc * ws[None, :]).to(O.dtype.element_ty)
    at = O + tl.program_id(2) * sop + rm[:, None] * som + rn[None, :]
    tl.store(at, out, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def one_row(X, XS, W, WS, O, N, K, swn, BN: tl.constexpr, BK: tl.constexpr, HAS_XS: tl.constexpr,
            EVEN: tl.constexpr):
    """:func:`rows_product` for one row (a decode step at batch 1) on the CUDA cores: ``O[n] = (X .
    W[n]) * XS * WS[n]``. A program takes ``BN`` outputs over the whole inner dimension, ``BK`` at
    a time; each weight and input is made float32 (an E4M3 or int8 value exactly), their
    products summed in fp32 column by column, then across the columns in a fixed order, scaled
    and rounded once. ``EVEN``: ``N`` a multiple of ``BN`` and ``K`` of ``BK`` (no masks)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        if EVEN:
            x = tl.load(X + kk)
            w = tl.load(W + rn[:, None] * swn + kk[None, :])
        else:
            x = tl.load(X + kk, mask=kk < K, other=0.0)
            w = tl.load(W + rn[:, None] * swn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, 1)
    if HAS_XS:
        out = out * tl.load(XS)
    out = out * tl.load(WS + rn, mask=rn < N, other=0.0)
    tl.store(O + rn, out.to(O.dtype.element_ty), mask=rn < N)


@triton.jit
def fp8_tiles(X, XS, W, WS, O, M, K, sxm, swn, som, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              EVEN_M: tl.constexpr, PRECISE: tl.constexpr):
    """``O[m, n] = (X[m] . W[n]) * XS[m] * WS[n]`` for FP8 layers past a few rows, on the tensor
    cores' own E4M3 products (no conversion), summed in fp32: each step of ``BK`` inputs summed
    at the tensor cores' fast accumulation, the steps added in full fp32 where ``PRECISE``
    (otherwise the whole inner dimension at fast accumulation, as torch's fast-accumulating
    product). A program takes ``BM`` rows by ``BN`` outputs; programs of one column of weights
    are launched together (the rows are ``program_id(0)``), so the weights are read from memory
    about once. The caller sees that the outputs are a multiple of ``BN`` and the inner
    dimension of ``BK``; ``EVEN_M``: the rows a multiple of ``BM`` (no mask)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    xp = X + rm[:, None] * sxm + rk[None, :]
    wp = W + rn[None, :] * swn + rk[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        if EVEN_M:
            x = tl.load(xp)
        else:
            x = tl.load(xp, mask=rm[:, None] < M, other=0.0)
        if PRECISE:
            acc = tl.dot(x, tl.load(wp), acc, max_num_imprecise_acc=BK)
        else:
            acc = tl.dot(x, tl.load(wp), acc)
        xp += BK
        wp += BK
    xs = tl.load(XS + rm, mask=rm < M, other=0.0)
    out = acc * xs[:, None] * tl.load(WS + rn)[None, :]
    tl.store(O + rm[:, None] * som + rn[None, :], out.to(O.dtype.element_ty), mask=rm[:, None] < M)


@triton.jit
def int8_tiles(X, W, WS, O, M, K, sxm, swn, som, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               BF16: tl.constexpr):
    """``O[m, n] = (X[m] . W[n]) * WS[n]`` for int8 weight-only layers past a few rows, made as
    ``O^T`` tiles of ``BN`` outputs by ``BM`` rows: the weights (read as bytes, each made fp16 by
    its bits, exact, as :func:`rows_product` makes them; bf16 where ``BF16``, the rows' dtype) are
    the left operand, handed to the tensor cores from registers, and the rows the right one. The
    products summed in fp32, scaled once, rounded once to ``O``'s dtype. Programs of one tile of
    weights are launched together (the rows are ``program_id(0)``), so the weights are read from
    memory about once. The caller sees that the outputs are a multiple of ``BN`` and the inner
    dimension of ``BK``."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    wp = W + rn[:, None] * swn + rk[None, :]
    xp = X + rm[None, :] * sxm + rk[:, None]
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for _ in range(0, K, BK):
        w = tl.load(wp)
        h = (((w ^ 0x80).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1152.0).to(tl.float16)
        x = tl.load(xp, mask=rm[None, :] < M, other=0.0)
        if BF16:
            acc = tl.dot(h.to(tl.bfloat16), x, acc)
        else:
            acc = tl.dot(h, x, acc)
        wp += BK
        xp += BK
    out = acc * tl.load(WS + rn)[:, None]
    tl.store(O + rm[None, :] * som + rn[:, None], out.to(O.dtype.element_ty), mask=rm[None, :] < M)


@triton.jit
def sum_parts(P, O, NUMEL, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """``O[i] = sum(P[s, i] for s in range(SPLIT))``, in that order (the same sum every call),
    rounded once to ``O``'s dtype: :func:`rows_product`'s parts made one."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < NUMEL
    acc = tl.load(P + i, mask=m, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(P + s * NUMEL + i, mask=m, other=0.0)
    tl.store(O + i, acc.to(O.dtype.element_ty), mask=m)


@triton.jit
def silu_product_to_fp8(G, U, Q, S, sg, su, sq, N, FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr, TINY: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Row ``program_id`` of ``silu(G) * U`` as transformers' two kernels round it (SiLU, then the
    product, each rounded to ``G``'s dtype), then in E4M3 with its scale (:func:`_store_fp8`):
    the gated MLP's down projection's input, written once in FP8."""
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < N
    dtype = G.dtype.element_ty
    g = tl.load(G + r * sg + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + r * su + c, mask=m, other=0.0).to(tl.float32)
    x = ((g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * u).to(dtype).to(tl.float32)
    _store_fp8(x, Q, S, r, sq, c, m, FP8_MAX, INV_MAX, TINY, BLOCK)
