"""The Triton kernel of :mod:`.weight_only`'s int4 layers: imported only where it runs (a GPU
with Triton), never at graphwrap's import."""

import triton
import triton.language as tl


@triton.jit
def _nibbles(b):
    """Bytes ``b`` (uint8) as their low and high four bits, each a value 0-15 in fp16, exact:
    the bits under 0x6400's exponent are 1024 + the value, less 1024."""
    lo = ((b & 0xF).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
    hi = ((b >> 4).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
    return (lo - 1024.0).to(tl.float16), (hi - 1024.0).to(tl.float16)


@triton.jit
def int4_product(X, W, S, O, M, N, GROUPS, PER, sxm, swn, ssn, som, sop, BM: tl.constexpr, BN: tl.constexpr,
                 STEP: tl.constexpr, SPLIT: tl.constexpr):
    """``O = X @ Wt``: rows ``X`` (fp16 or bf16) times the weights that ``W`` and ``S`` stand for,
    made in ``X``'s dtype as the layer's own unpacking makes them (``offset + value * scale`` in
    fp32, rounded once), summed in fp32, rounded once to ``O``'s dtype. ``W [N, K / 2]``: int4
    values 0-15, two a byte, in groups of 128 inputs: byte ``j`` of a group's 64 holds input ``j``
    in its low four bits and input ``64 + j`` in its high four. ``S [N, K / 128, 2]``: each
    group's scale and offset. A program takes ``BN`` outputs of ``BM`` rows and reads those
    weights once, ``STEP`` groups at a time: ``PER`` of the ``GROUPS`` groups (a multiple of
    ``STEP``) from the ``program_id(2)``-th ``PER``; with ``SPLIT`` > 1 it writes that part's sum
    in fp32 to ``O``'s part ``program_id(2)`` (``sop`` apart), for ``sum_parts``."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    c = tl.arange(0, STEP * 64)  # a step's bytes of one output
    of = c // 64  # the group of each, within the step
    low = of * 128 + c % 64  # the input of each byte's low four bits (its high four: 64 on)
    in_m = rm < M
    in_n = rn < N
    dtype = X.dtype.element_ty
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    first = tl.program_id(2) * PER
    for i in range(0, PER, STEP):
        g = first + i
        here = (g + of) < GROUPS  # (past the last group: zeros)
        at = X + rm[:, None] * sxm + g * 128 + low[None, :]
        xl = tl.load(at, mask=in_m[:, None] & here[None, :], other=0.0)
        xh = tl.load(at + 64, mask=in_m[:, None] & here[None, :], other=0.0)
        keep = in_n[None, :] & here[:, None]
        b = tl.load(W + rn[None, :] * swn + g * 64 + c[:, None], mask=keep, other=0)
        sat = S + rn[None, :] * ssn + (g + of[:, None]) * 2
        scale = tl.load(sat, mask=keep, other=0.0).to(tl.float32)
        offset = tl.load(sat + 1, mask=keep, other=0.0).to(tl.float32)
        lo, hi = _nibbles(b)
        acc = tl.dot(xl, (offset + lo.to(tl.float32) * scale).to(dtype), acc)
        acc = tl.dot(xh, (offset + hi.to(tl.float32) * scale).to(dtype), acc)
    at = O + tl.program_id(2) * sop + rm[:, None] * som + rn[None, :]
    tl.store(at, acc.to(O.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])
