"""The Triton kernel of :mod:`.norm`: imported only where it runs (a GPU with Triton), never at
graphwrap's import."""

import triton
import triton.language as tl


@triton.jit
def rms_norm(X, W, O, sx, so, N, eps, BLOCK: tl.constexpr):
    """Row ``program_id``: ``x * rsqrt(mean(x^2) + eps) * w``, in fp32, rounded once."""
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(X + r * sx + c, mask=m, other=0.0).to(tl.float32)
    w = tl.load(W + c, mask=m, other=0.0).to(tl.float32)
    v = tl.sum(x * x, 0) / N
    tl.store(O + r * so + c, (x * tl.rsqrt(v + eps) * w).to(O.dtype.element_ty), mask=m)
