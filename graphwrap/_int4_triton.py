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
def _level(w, BITS: tl.constexpr):
    """The four bits of int32 words ``w`` under ``BITS`` (a mask of bits 0-19), times
    ``BITS``' lowest bit, in float32: or-ed under 0x4B000000's exponent they are 2^23 plus that
    value, less 2^23 (exact: under 2^23)."""
    return ((w & BITS) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def int4_row(X, W, S, O, N, GROUPS, sxm, swn, ssn, som, sop, BN: tl.constexpr, STEP: tl.constexpr,
             PER: tl.constexpr):
    """Row ``program_id(0)`` of :func:`int4_product`'s ``O`` without the tensor cores, for a
    step's one row: ``W`` read as int32 words (a group's 64 bytes are 16 words; word ``u`` holds
    inputs ``4u + i`` in bits ``8i`` to ``8i + 3`` and inputs ``64 + 4u + i`` in the four above),
    ``S`` as int32 words (each group's scale in the low half, its offset in the high).
    ``O[n] = sum over groups of scale * (sum of value * x) + offset * (sum of x)``, each sum in
    fp32. Each value is made float32 by its bits where they lie (:func:`_level`: the value times
    2^b for bits ``b`` to ``b + 3``; the top three values of a word shifted down 12 bits first)
    and multiplied by its input times 2^-b: exactly value times input, two instructions and a
    multiply-add a value. A program takes ``BN`` outputs, reading their weights once, ``STEP``
    groups at a time over ``PER`` groups (unrolled) from the ``program_id(2) * PER``-th; its sum to
    ``O``'s part ``program_id(2)`` (``sop`` apart)."""
    r = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    n = rn[None, None, :]
    u = tl.arange(0, 16)[None, :, None]
    acc = tl.zeros((STEP, 16, BN), dtype=tl.float32)
    first = tl.program_id(2) * PER
    for i in tl.static_range(0, PER, STEP):
        g = first + i + tl.arange(0, STEP)[:, None, None]
        here = g < GROUPS
        keep = here & (n < N)
        w = tl.load(W + n * swn + g * 16 + u, mask=keep, other=0)
        pair = tl.load(S + n * ssn + g, mask=keep, other=0)
        scale = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        offset = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        at = X + r * sxm + g * 128 + u * 4
        x0 = tl.load(at, mask=here, other=0.0).to(tl.float32)  # (bits 0-3: input 4u)
        x1 = tl.load(at + 64, mask=here, other=0.0).to(tl.float32)  # (bits 4-7: input 64 + 4u)
        x2 = tl.load(at + 1, mask=here, other=0.0).to(tl.float32)
        x3 = tl.load(at + 65, mask=here, other=0.0).to(tl.float32)
        x4 = tl.load(at + 2, mask=here, other=0.0).to(tl.float32)
        x5 = tl.load(at + 66, mask=here, other=0.0).to(tl.float32)
        x6 = tl.load(at + 3, mask=here, other=0.0).to(tl.float32)
        x7 = tl.load(at + 67, mask=here, other=0.0).to(tl.float32)
        sums = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
        top = w >> 12  # (bits 20-31 to 8-19)
        part = _level(w, 0xF) * x0
        part += _level(w, 0xF0) * (x1 * 0.0625)
        part += _level(w, 0xF00) * (x2 * 0.00390625)
        part += _level(w, 0xF000) * (x3 * 0.000244140625)
        part += _level(w, 0xF0000) * (x4 * 0.0000152587890625)
        part += _level(top, 0xF00) * (x5 * 0.00390625)
        part += _level(top, 0xF000) * (x6 * 0.000244140625)
        part += _level(top, 0xF0000) * (x7 * 0.0000152587890625)
        acc += part * scale + sums * offset
    out = tl.sum(tl.sum(acc, 1), 0)
    tl.store(O + tl.program_id(2) * sop + r * som + rn, out.to(O.dtype.element_ty), mask=rn < N)


@triton.jit
def int4_tiles(X, W, S, O, M, GROUPS, PER, sxm, swn, ssn, som, sop, BM: tl.constexpr, BN: tl.constexpr,
               BF16: tl.constexpr):
    """:func:`int4_product` made as ``O^T`` tiles of ``BN`` outputs by ``BM`` rows: each group's
    values (:func:`_nibbles`, fp16 in registers; bf16 where ``BF16``, the rows' dtype) are the
    left operand, handed to the tensor cores from registers, and the rows the right one, so no
    weight passes through shared memory. ``S`` read as int32 words (each group's scale in the low
    half, its offset in the high, as :func:`int4_row`). Each group's products summed in fp32,
    scaled and offset in fp32, the groups added in order, rounded once to ``O``'s dtype. Programs
    of one tile of weights are launched together (the rows are ``program_id(0)``), so the weights
    are read from memory about once. A program takes ``PER`` of the ``GROUPS`` groups from the
    ``program_id(2) * PER``-th and writes to ``O``'s part ``program_id(2)`` (``sop`` apart; fp32
    parts for ``sum_parts`` where there are several). The caller sees that the outputs are a
    multiple of ``BN``."""
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
        xl = tl.load(xp, mask=rows, other=0.0)
        xh = tl.load(xp + 64, mask=rows, other=0.0)
        if BF16:
            part = tl.dot(lo.to(tl.bfloat16), xl)
            part = tl.dot(hi.to(tl.bfloat16), xh, part)
        else:
            part = tl.dot(lo, xl)
            part = tl.dot(hi, xh, part)
        pair = tl.load(sp)
        scale = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        offset = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        sums = tl.sum(xl.to(tl.float32), 0) + tl.sum(xh.to(tl.float32), 0)
        acc += part * scale[:, None] + offset[:, None] * sums[None, :]
        wp += 64
        xp += 128
        sp += 1
    at = O + tl.program_id(2) * sop + rm[None, :] * som + rn[:, None]
    tl.store(at, acc.to(O.dtype.element_ty), mask=rows)
