"""The Triton kernels of :mod:`.paged_attention`: imported only where they run (a GPU with
Triton), never at graphwrap's import."""

import triton
import triton.language as tl


@triton.jit
def paged_walk(q, K, V, T, b, h, begin, end, n_pos, first, scale, softcap, skb, skt, skh, stb, GP: tl.constexpr,
               D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr,
               SOFTCAP: tl.constexpr):
    """One row's positions ``[begin, end)`` for one key head, a tile at a time with an online
    softmax: ``(maximum, denominator, unscaled sums [GP, DP])`` of each query head of the group
    (``q [GP, DP]``). Inlined into the kernels below."""
    d = tl.arange(0, DP)
    dm = d < D
    t = tl.arange(0, TILE)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for start in range(begin, end, TILE):
        pos = start + t
        pm = (pos < n_pos) & (pos >= first)
        blk = tl.load(T + b * stb + pos // BLOCK, mask=pm, other=0)
        base = blk.to(tl.int64) * skb + (pos % BLOCK) * skt + h * skh
        kv_mask = pm[:, None] & dm[None, :]
        k = tl.load(K + base[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # (an FP8 pool: read back)
        v = tl.load(V + base[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # (issued beside the keys)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
        s = tl.where(pm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def paged_decode(Q, K, V, T, L, O, scale, v_scale, window, softcap, sqb, sqh, skb, skt, skh, stb, sob, soh,
                 G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                 TILE: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr):
    """Program ``(b, h)``: row ``b``'s query heads of key head ``h`` over the row's positions
    (``scale``: the scores', times the keys' FP8 scale where the pool is FP8; ``v_scale``: the
    values', 1 in the model's dtype)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_pos = tl.load(L + b)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    gm = g < G
    dm = d < D
    heads = h * G + g
    q = tl.load(Q + b * sqb + heads[:, None] * sqh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
    first = tl.where(window > 0, tl.maximum(n_pos - window, 0), 0)  # a sliding window's first position
    m_i, l_i, acc = paged_walk(q, K, V, T, b, h, (first // TILE) * TILE, n_pos, n_pos, first, scale, softcap,
                               skb, skt, skh, stb, GP, D, DP, BLOCK, TILE, IEEE, SOFTCAP)
    out = acc * (v_scale / l_i)[:, None]
    tl.store(O + b * sob + heads[:, None] * soh + d[None, :], out.to(O.dtype.element_ty),
             mask=gm[:, None] & dm[None, :])


@triton.jit
def _per(tiles, W, target, S: tl.constexpr, BALANCE: tl.constexpr):
    """The tiles each of a row's programs takes: its ``tiles`` over ``S``; with ``BALANCE``, at
    least the step's share of ``target`` programs (``W``: every row's tiles summed, the same
    for every program of the step, so that the parts and their join agree)."""
    per = tl.cdiv(tiles, S)
    if BALANCE:
        per = tl.maximum(per, tl.cdiv(tl.load(W) * tl.num_programs(1), target).to(per.dtype))
    return per


@triton.jit
def paged_decode_part(Q, K, V, T, L, P, W, target, scale, window, softcap, sqb, sqh, skb, skt, skh, stb,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                      TILE: tl.constexpr, S: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr,
                      BALANCE: tl.constexpr):
    """Program ``(b, h, s)``: the ``s``-th of row ``b``'s runs of tiles (a row of few tiles uses as
    many programs as it has tiles; with ``BALANCE``, a row takes programs of at least the step's
    share of tiles, :func:`_per`); writes its part: the unscaled sums ``[G, D]``, then the
    softmax's denominator and maximum, per query head."""
    b, h, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_pos = tl.load(L + b)
    first = tl.where(window > 0, tl.maximum(n_pos - window, 0), 0)
    lo = (first // TILE) * TILE
    tiles = tl.maximum(tl.cdiv(n_pos - lo, TILE), 1)
    per = _per(tiles, W, target, S, BALANCE)  # tiles a part
    begin = lo + part * per * TILE
    if begin < n_pos:  # (a part past the row's tiles reads and writes nothing: the join never reads it)
        g, d = tl.arange(0, GP), tl.arange(0, DP)
        gm, dm = g < G, d < D
        heads = h * G + g
        q = tl.load(Q + b * sqb + heads[:, None] * sqh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        end = tl.minimum(begin + per * TILE, n_pos)
        m_i, l_i, acc = paged_walk(q, K, V, T, b, h, begin, end, n_pos, first, scale, softcap, skb, skt, skh, stb,
                                   GP, D, DP, BLOCK, TILE, IEEE, SOFTCAP)
        row = ((b * tl.num_programs(1) + h) * S + part) * GP + g  # this part's line of each query head
        tl.store(P + row[:, None] * (DP + 2) + d[None, :], acc, mask=gm[:, None] & dm[None, :])
        tl.store(P + row * (DP + 2) + DP, l_i, mask=gm)
        tl.store(P + row * (DP + 2) + DP + 1, m_i, mask=gm)


@triton.jit
def paged_decode_join(L, P, O, W, target, v_scale, window, sob, soh, G: tl.constexpr, GP: tl.constexpr,
                      GJ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, TILE: tl.constexpr, S: tl.constexpr,
                      BALANCE: tl.constexpr):
    """Program ``(b, h)``: row ``b``'s parts for key head ``h``, each rescaled to the largest
    maximum, over the summed denominators. The ``S`` parts' loads unrolled (a part past those
    that read a tile masked off), so that they are issued together rather than one L2 trip after
    another; the group's ``G`` query heads only (``GJ``: a power of two from ``G``; a part holds
    ``GP`` lines)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_pos = tl.load(L + b)
    first = tl.where(window > 0, tl.maximum(n_pos - window, 0), 0)
    lo = (first // TILE) * TILE
    tiles = tl.maximum(tl.cdiv(n_pos - lo, TILE), 1)
    parts = tl.cdiv(tiles, _per(tiles, W, target, S, BALANCE))  # the parts that read a tile
    g = tl.arange(0, GJ)
    d = tl.arange(0, DP)
    gm = g < G
    dm = d < D
    top = ((b * tl.num_programs(1) + h) * S) * GP + g
    m = tl.full([GJ], float("-inf"), tl.float32)
    for part in tl.static_range(S):
        m = tl.maximum(m, tl.load(P + (top + part * GP) * (DP + 2) + DP + 1, mask=gm & (part < parts),
                                  other=float("-inf")))
    acc = tl.zeros([GJ, DP], tl.float32)
    den = tl.zeros([GJ], tl.float32)
    for part in tl.static_range(S):
        row = top + part * GP
        ok = gm & (part < parts)
        w = tl.where(ok, tl.exp(tl.load(P + row * (DP + 2) + DP + 1, mask=ok, other=0.0) - m), 0.0)
        den += w * tl.load(P + row * (DP + 2) + DP, mask=ok, other=0.0)
        acc += w[:, None] * tl.load(P + row[:, None] * (DP + 2) + d[None, :], mask=ok[:, None] & dm[None, :],
                                    other=0.0)
    out = acc * (v_scale / den)[:, None]
    tl.store(O + b * sob + (h * G + g)[:, None] * soh + d[None, :], out.to(O.dtype.element_ty),
             mask=gm[:, None] & dm[None, :])
