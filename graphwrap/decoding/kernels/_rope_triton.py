"""The Triton kernel of :mod:`.rope`: imported only where it runs (a GPU with Triton), never at
graphwrap's import."""

import triton
import triton.language as tl


@triton.jit
def _heads(X, O, c1, c2, s1, s2, sxh, soh, H: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr,
           BH: tl.constexpr):
    """One position's ``H`` heads: ``X`` and ``O`` point at its head 0."""
    h = tl.arange(0, BH)
    j = tl.arange(0, HP)
    m = (h < H)[:, None] & (j < HALF)[None, :]
    x = X + h[:, None] * sxh + j[None, :]
    x1 = tl.load(x, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=m, other=0.0).to(tl.float32)
    o = O + h[:, None] * soh + j[None, :]
    tl.store(o, (x1 * c1[None, :] - x2 * s1[None, :]).to(O.dtype.element_ty), mask=m)
    tl.store(o + HALF, (x2 * c2[None, :] + x1 * s2[None, :]).to(O.dtype.element_ty), mask=m)


@triton.jit
def rope(Q, K, COS, SIN, QO, KO, S, sqb, sqh, sqs, skb, skh, sks, scb, scs, ssb, sss, sob, soh, sos, sob_k, soh_k,
         sos_k, HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0)  # one position of one sequence: b * S + s
    b = t // S
    s = t % S
    j = tl.arange(0, HP)
    jm = j < HALF
    c = COS + b * scb + s * scs + j
    c1 = tl.load(c, mask=jm, other=0.0).to(tl.float32)
    c2 = tl.load(c + HALF, mask=jm, other=0.0).to(tl.float32)
    n = SIN + b * ssb + s * sss + j
    s1 = tl.load(n, mask=jm, other=0.0).to(tl.float32)
    s2 = tl.load(n + HALF, mask=jm, other=0.0).to(tl.float32)
    _heads(Q + b * sqb + s * sqs, QO + b * sob + s * sos, c1, c2, s1, s2, sqh, soh, HQ, HALF, HP, BH)
    _heads(K + b * skb + s * sks, KO + b * sob_k + s * sos_k, c1, c2, s1, s2, skh, soh_k, HK, HALF, HP, BH)
