"""The Triton kernel of :mod:`.weight_only`'s int4 layers: imported only where it runs (a GPU
with Triton), never at graphwrap's import."""

import triton
import triton.language as tl

# Four bytes (one register) to their four low (LOW) or high (HIGH) four bits as fp16, two a
# register: prmt spreads the bytes to (b0, 0, b1, 0) and (b2, 0, b3, 0); lop3 keeps each
# half's four bits under 0x6400 (fp16 1024, whose unit in the last place is 1); the low bits are
# then 1024 + v less 1024, the high 1024 + 16 v times 1/16 less 64: exact, three instructions
# for two values.
_SPREAD = """
{
.reg .b32 a0, a1, c, d;
prmt.b32 a0, 0, $2, 0x0504;
prmt.b32 a1, 0, $2, 0x0706;
lop3.b32 $0, a0, MASK, 0x64006400, 0xea;
lop3.b32 $1, a1, MASK, 0x64006400, 0xea;
"""
LOW = tl.constexpr(_SPREAD.replace("MASK", "0x000f000f") + """mov.b32 c, 0x64006400;
sub.f16x2 $0, $0, c;
sub.f16x2 $1, $1, c;
}""")
HIGH = tl.constexpr(_SPREAD.replace("MASK", "0x00f000f0") + """mov.b32 c, 0x2c002c00;
mov.b32 d, 0xd400d400;
fma.rn.f16x2 $0, $0, c, d;
fma.rn.f16x2 $1, $1, c, d;
}""")


@triton.jit
def _nibbles(b):
    """Bytes ``b`` (uint8) as their low and high four bits, each a value 0-15 in fp16, exact
    (:data:`LOW`, :data:`HIGH`: four bytes an instruction sequence)."""
    lo = tl.inline_asm_elementwise(LOW, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
    hi = tl.inline_asm_elementwise(HIGH, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
    return lo, hi


@triton.jit
def int4_product(X, W, S, O, M, N, GROUPS, PER, sxm, swn, ssn, som, sop, BM: tl.constexpr, BN: tl.constexpr,
                 SPLIT: tl.constexpr, BF16: tl.constexpr):
    """``O[m, n] = sum over groups g of (X[m, g] . Q[n, g]) * scale[n, g] + sum(X[m, g]) * offset[n, g]``:
    rows ``X`` in fp16 or bf16 (bf16 where ``BF16``), weights ``W [N, K / 2]`` in int4 values
    0-15, two a byte, in groups of 128 inputs: byte ``j`` of a group's 64 holds input ``j`` in its
    low four bits and input ``64 + j`` in its high four; ``S [N, K / 128, 2]`` each group's scale
    and offset (a weight is ``offset + value * scale``). Each value is exact in fp16 and bf16, so
    the products are the rows' own, summed in fp32, each group's sum scaled in fp32, rounded once
    to ``O``'s dtype. A program takes ``BN`` outputs of ``BM`` rows and reads those weights
    once: ``PER`` of the ``GROUPS`` groups from the ``program_id(2)``-th; with ``SPLIT`` > 1 it
    writes that part's sum in fp32 to ``O``'s part ``program_id(2)`` (``sop`` apart), for
    ``sum_parts``."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rj = tl.arange(0, 64)
    in_m = rm < M
    in_n = rn < N
    first = tl.program_id(2) * PER
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for i in range(0, PER):
        g = first + i
        here = g < GROUPS  # (the last part may hold fewer groups: the rest read as zeros)
        at = X + rm[:, None] * sxm + g * 128 + rj[None, :]
        xl = tl.load(at, mask=in_m[:, None] & here, other=0.0)
        xh = tl.load(at + 64, mask=in_m[:, None] & here, other=0.0)
        b = tl.load(W + rn[None, :] * swn + g * 64 + rj[:, None], mask=in_n[None, :] & here, other=0)
        lo, hi = _nibbles(b)
        if BF16:
            part = tl.dot(xl, lo.to(tl.bfloat16))
            part = tl.dot(xh, hi.to(tl.bfloat16), part)
        else:
            part = tl.dot(xl, lo)
            part = tl.dot(xh, hi, part)
        scale = tl.load(S + rn * ssn + g * 2, mask=in_n & here, other=0.0).to(tl.float32)
        offset = tl.load(S + rn * ssn + g * 2 + 1, mask=in_n & here, other=0.0).to(tl.float32)
        sums = tl.sum(xl.to(tl.float32), 1) + tl.sum(xh.to(tl.float32), 1)
        acc += part * scale[None, :] + sums[:, None] * offset[None, :]
    at = O + tl.program_id(2) * sop + rm[:, None] * som + rn[None, :]
    tl.store(at, acc.to(O.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


@triton.jit
def int4_tiles(X, W, S, O, M, GROUPS, PER, sxm, swn, ssn, som, sop, BM: tl.constexpr, BN: tl.constexpr,
               BF16: tl.constexpr):
    """:func:`int4_product`'s ``O`` made as ``O^T`` tiles of ``BN`` outputs by ``BM`` rows, the
    weights made whole first: each group's values (:func:`_nibbles`) times its scale plus its
    offset in fp16 (``S`` read as int32 words: the scale in the low half, the offset in the
    high), so each weight is the unpacked weight in fp16 (then bf16 where ``BF16``, the rows'
    dtype), as the layer's product off the GPU takes it in the rows' dtype. Those are
    the left operand, handed to the tensor cores from registers, and the rows the right one; the
    products summed in fp32 over every group and rounded once to ``O``'s dtype, so the tensor
    cores' sums run on across groups with no scaling between them (scaling each group's sum, as
    :func:`int4_product` does, made the tiles wait on the tensor cores once a group: 1.05-1.5x
    the time). Programs of one tile of weights are launched together (the rows are
    ``program_id(0)``), so the weights are read from memory about once. A program takes ``PER``
    of the ``GROUPS`` groups from the ``program_id(2) * PER``-th and writes to ``O``'s part
    ``program_id(2)`` (``sop`` apart; fp32 parts for ``sum_parts`` where there are several).
    The caller sees that the outputs are a multiple of ``BN``."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rj = tl.arange(0, 64)
    first = tl.program_id(2) * PER
    wp = W + rn[:, None] * swn + first * 64 + rj[None, :]
    xp = X + rm[None, :] * sxm + first * 128 + rj[:, None]
    sp = S + rn * ssn + first
    rows = rm[None, :] < M
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for _ in range(first, tl.minimum(first + PER, GROUPS)):
        lo, hi = _nibbles(tl.load(wp))
        pair = tl.load(sp)
        scale = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)[:, None]
        offset = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)[:, None]
        xl = tl.load(xp, mask=rows, other=0.0)
        xh = tl.load(xp + 64, mask=rows, other=0.0)
        if BF16:
            acc = tl.dot((lo * scale + offset).to(tl.bfloat16), xl, acc)
            acc = tl.dot((hi * scale + offset).to(tl.bfloat16), xh, acc)
        else:
            acc = tl.dot(lo * scale + offset, xl, acc)
            acc = tl.dot(hi * scale + offset, xh, acc)
        wp += 64
        xp += 128
        sp += 1
    at = O + tl.program_id(2) * sop + rm[None, :] * som + rn[:, None]
    tl.store(at, acc.to(O.dtype.element_ty), mask=rows)
