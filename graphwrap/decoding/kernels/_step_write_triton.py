"""The Triton kernel of :mod:`.step_write`: imported only where it runs (a GPU with Triton), never at
graphwrap's import."""

import triton
import triton.language as tl


@triton.jit
def _one(X, P, sxh, sph, inv, H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, DP: tl.constexpr,
         SCALED: tl.constexpr, LARGEST: tl.constexpr):
    """One row's ``H`` heads of ``D`` from ``X`` (its head 0) to ``P`` (its slot's head 0); with
    ``SCALED`` (an FP8 pool), each times ``inv`` (one over the layer's scale), held within
    +-``LARGEST``, then rounded to the pool's dtype."""
    h = tl.arange(0, BH)
    j = tl.arange(0, DP)
    m = (h < H)[:, None] & (j < D)[None, :]
    x = tl.load(X + h[:, None] * sxh + j[None, :], mask=m)
    if SCALED:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * inv, -LARGEST), LARGEST)
    tl.store(P + h[:, None] * sph + j[None, :], x.to(P.dtype.element_ty), mask=m)


@triton.jit
def write_slots(K, V, KP, VP, WHERE, OFFSET, skn, skh, svn, svh, spb, spo, sph, k_inv, v_inv, H: tl.constexpr,
                D: tl.constexpr, BH: tl.constexpr, DP: tl.constexpr, SCALED: tl.constexpr, LARGEST: tl.constexpr):
    i = tl.program_id(0)  # one row: its key and value go to block WHERE[i], offset OFFSET[i]
    at = tl.load(WHERE + i).to(tl.int64) * spb + tl.load(OFFSET + i).to(tl.int64) * spo
    _one(K + i * skn, KP + at, skh, sph, k_inv, H, D, BH, DP, SCALED, LARGEST)
    _one(V + i * svn, VP + at, svh, sph, v_inv, H, D, BH, DP, SCALED, LARGEST)
