"""The Triton kernels of :mod:`.piece_attention`: imported only where a piece runs on a GPU with
Triton (never at graphwrap's import)."""

import triton
import triton.language as tl


@triton.jit
def paged_piece(Q, K, V, LINE, AT, O, PART, ML, scale, v_scale, window, softcap, sqh, sqi, skb, skt, skh, soi, soh,
                G: tl.constexpr, W: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                TILE: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr, PREC: tl.constexpr,
                SOFTCAP: tl.constexpr):
    h = tl.program_id(0)
    r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # query rows of key head h: (head of the group, position)
    rm = r < G * W
    g = r // W
    i = r % W
    heads = h * G + g
    start = tl.load(AT)
    valid = tl.load(AT + 1)
    qpos = start + i
    last = start + tl.minimum(i, valid - 1)  # the last position a query sees (a padding query: the last valid's)
    d = tl.arange(0, DP)
    dm = d < D
    q = tl.load(Q + heads[:, None] * sqh + i[:, None] * sqi + d[None, :], mask=rm[:, None] & dm[None, :],
                other=0.0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)  # (in base 2: scores times log2(e))
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DP], tl.float32)
    end = tl.max(tl.where(rm, last, 0)) + 1
    first = tl.where(window > 0, tl.maximum(tl.min(tl.where(rm, qpos, end)) - window + 1, 0), 0)
    lo = (first // TILE) * TILE
    share = tl.cdiv(tl.cdiv(end - lo, TILE), SPLITS) * TILE  # keys of each split
    a = lo + tl.program_id(2) * share
    b = tl.minimum(end, a + share)
    # Tiles every query row of the program sees whole (below the first row's last position, no
    # window) need no mask: they go first, then the rest under the mask.
    seen_by_all = tl.where(window > 0, 0, tl.min(tl.where(rm, last, end)) + 1)
    mid = tl.maximum(a, tl.minimum(b, a + (tl.maximum(seen_by_all - a, 0) // TILE) * TILE))
    for kstart in range(a, mid, TILE):
        m_i, l_i, acc = _tile(q, K, V, LINE, m_i, l_i, acc, kstart, end, last, qpos, d, dm, h, scale, window, softcap,
                              skb, skt, skh, BLOCK, TILE, PREC, SOFTCAP, False)
    for kstart in range(mid, b, TILE):
        m_i, l_i, acc = _tile(q, K, V, LINE, m_i, l_i, acc, kstart, end, last, qpos, d, dm, h, scale, window, softcap,
                              skb, skt, skh, BLOCK, TILE, PREC, SOFTCAP, True)
    acc = acc * v_scale  # (the values' FP8 scale; 1 in the model's dtype)
    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(O + i[:, None] * soi + heads[:, None] * soh + d[None, :], out.to(O.dtype.element_ty),
                 mask=rm[:, None] & dm[None, :])
    else:  # this split's share: its sums and its maximum, joined by the caller
        at = (tl.program_id(2) * tl.num_programs(0) + h) * (G * W) + r
        tl.store(PART + at[:, None] * DP + d[None, :], acc, mask=rm[:, None])
        tl.store(ML + at, m_i, mask=rm)
        tl.store(ML + SPLITS * tl.num_programs(0) * G * W + at, l_i, mask=rm)


@triton.jit
def _tile(q, K, V, LINE, m_i, l_i, acc, kstart, end, last, qpos, d, dm, h, scale, window, softcap, skb, skt, skh,
          BLOCK: tl.constexpr, TILE: tl.constexpr, PREC: tl.constexpr, SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """One tile of keys from ``kstart`` into the online softmax (``MASKED``: each query's own
    positions and window, and the keys past ``end``; else every key of the tile is seen)."""
    pos = kstart + tl.arange(0, TILE)
    pm = pos < end
    blk = tl.load(LINE + pos // BLOCK, mask=pm, other=0)
    base = blk.to(tl.int64) * skb + (pos % BLOCK) * skt + h * skh
    kv_mask = pm[:, None] & dm[None, :]
    k = tl.load(K + base[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # (an FP8 pool: read back)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if SOFTCAP:
        s = s * scale
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
        s = s * 1.4426950408889634
    else:
        s = s * (scale * 1.4426950408889634)
    if MASKED:
        seen = (pos[None, :] <= last[:, None]) & pm[None, :]
        if window > 0:
            seen = seen & (pos[None, :] > qpos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a row that sees nothing in this tile yet)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + base[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def join_splits(PART, ML, O, soi, soh, G: tl.constexpr, W: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                SPLITS: tl.constexpr):
    n = tl.program_id(0)  # (key head, query row of its group)
    rows = tl.num_programs(0)
    s = tl.arange(0, SPLITS)
    m = tl.load(ML + s * rows + n)
    l = tl.load(ML + (SPLITS + s) * rows + n)
    top = tl.max(m, 0)
    w = tl.exp2(m - tl.where(top == float("-inf"), 0.0, top))
    d = tl.arange(0, DP)
    part = tl.load(PART + (s[:, None] * rows + n) * DP + d[None, :])
    out = tl.sum(part * w[:, None], 0) / tl.sum(l * w, 0)
    h = n // (G * W)
    r = n % (G * W)
    tl.store(O + (r % W) * soi + (h * G + r // W) * soh + d, out.to(O.dtype.element_ty), mask=d < D)
