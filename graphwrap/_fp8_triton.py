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
