"""A long prompt's piece's attention read straight from the paged pool (Triton).

A piece of ``W`` positions of one row attends over that row's positions up to each query's own:
its earlier positions, already in the pool, and its own, which its layers write there first.
Gathered into a span bucket for PyTorch's attention under a mask (as :mod:`.layers` does where
this kernel cannot run), it pays for the gather, for every masked and padded key, and for a
kernel that spreads 128 queries over few blocks of work: on a Llama-3-8B shape 5.3 ms of a
piece's 14.6 (``benchmarks/diagnostics/piece_profile.py``). Here each program takes one key
head and a tile of its query rows (the group's query heads times the piece's positions, as the
batch's fold lays them out), walks the row's line of the block table a tile of positions at a
time, only as far as its last query sees, with an online softmax. The piece's place (start,
valid positions, row) is read from the device, so one graph of the piece's width serves any
place and any length.
"""

import functools
import math
from typing import Optional

import torch

Tensor = torch.Tensor
TILE = 64  # key positions a program reads at a time
ROWS = 64  # query rows (heads of a group x positions) a program takes
SPLITS = 4  # programs sharing a tile of query rows, each over a quarter of its keys
STAGES = 2  # loads in flight in a program's loop
# (the fastest over 1,024-8,192 keys of the Llama-3-8B shape on an H200, in a graph, with
# ``benchmarks/diagnostics/piece_attention.py --tune``: 0.049 ms over 4,096 keys, 0.108 without splits)


def attend_piece(query: Tensor, k_pool: Tensor, v_pool: Tensor, line: Tensor, at: Tensor,
                 scale: Optional[float] = None, window: Optional[int] = None,
                 softcap: Optional[float] = None) -> Tensor:
    """``query [1, hq, W, d]`` of a piece at ``at = (start, valid, row)`` (a device tensor) over
    its row's blocks ``line`` in the pools ``[blocks, block, hkv, d]`` -> ``[1, W, hq, d]``.
    Query ``i`` sees positions up to ``start + min(i, valid - 1)`` (a padding query sees what
    the last valid one sees); with ``window``, only after ``start + i - window``; with
    ``softcap``, scores are ``softcap * tanh(s / softcap)``."""
    d = query.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return _launch(query[0], k_pool, v_pool, line, at, scale, int(window or 0), float(softcap or 0.0))[None]


def _launch(q: Tensor, k_pool: Tensor, v_pool: Tensor, line: Tensor, at: Tensor, scale: float, window: int,
            softcap: float, rows: int = ROWS, tile: int = TILE, warps: int = 4, stages: Optional[int] = STAGES,
            splits: int = SPLITS) -> Tensor:
    """The kernel over ``q [hq, W, d]`` -> ``[W, hq, d]`` (``rows``, ``tile``, ``warps``, ``stages``,
    ``splits``: its shape of work, for ``benchmarks/diagnostics/piece_attention.py --tune``; with
    ``splits``, each tile of query rows is taken by that many programs, each over its share of the
    keys, and their partial sums are joined here)."""
    import triton

    assert splits & (splits - 1) == 0, "splits: a power of two"
    hq, width, d = q.shape
    block, hkv = k_pool.shape[1], k_pool.shape[2]
    group = hq // hkv
    if q.stride(-1) != 1:
        q = q.contiguous()
    dp = max(16, 1 << (d - 1).bit_length())
    out = torch.empty((width, hq, d), dtype=q.dtype, device=q.device)
    if splits > 1:
        part = torch.empty((splits, hkv, group * width, dp), dtype=torch.float32, device=q.device)
        ml = torch.empty((2, splits, hkv, group * width), dtype=torch.float32, device=q.device)
    else:
        part = ml = out
    extra = {} if stages is None else {"num_stages": stages}
    _kernel()[(hkv, triton.cdiv(group * width, rows), splits)](
        q, k_pool, v_pool, line, at, out, part, ml, scale, window, softcap,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        out.stride(0), out.stride(1),
        G=group, W=width, D=d, DP=dp, BLOCK=block, TILE=tile, ROWS=rows, SPLITS=splits,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", SOFTCAP=bool(softcap), num_warps=warps, **extra)
    if splits > 1:  # the splits' partial sums joined: each weighed by its share of the softmax's total
        _joiner()[(hkv * group * width,)](part, ml, out, out.stride(0), out.stride(1), G=group, W=width, D=d, DP=dp,
                                          SPLITS=splits, num_warps=1)
    return out


def reference(query: Tensor, k_pool: Tensor, v_pool: Tensor, line: Tensor, at: Tensor,
              scale: Optional[float] = None, window: Optional[int] = None, softcap: Optional[float] = None) -> Tensor:
    """What :func:`attend_piece` computes, in torch (the row gathered, each query masked): for tests."""
    _, hq, width, d = query.shape
    block, hkv = k_pool.shape[1], k_pool.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    start, valid = int(at[0]), int(at[1])
    end = start + width
    blocks = line[:-(-end // block)]
    k = k_pool[blocks].flatten(0, 1)[:end].transpose(0, 1).repeat_interleave(hq // hkv, 0).float()  # [hq, end, d]
    v = v_pool[blocks].flatten(0, 1)[:end].transpose(0, 1).repeat_interleave(hq // hkv, 0).float()
    s = (query[0].float() @ k.transpose(1, 2)) * scale  # [hq, W, end]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(width, device=query.device)[:, None]
    j = torch.arange(end, device=query.device)[None, :]
    seen = j <= start + torch.clamp(i, max=valid - 1)
    if window:
        seen &= j > start + i - window
    s = s.masked_fill(~seen, float("-inf"))
    return (s.softmax(-1) @ v).to(query.dtype).transpose(0, 1)[None]


@functools.lru_cache(maxsize=None)
def _joiner():
    import triton
    import triton.language as tl

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

    return join_splits


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_piece(Q, K, V, LINE, AT, O, PART, ML, scale, window, softcap, sqh, sqi, skb, skt, skh, soi, soh,
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
        t = tl.arange(0, TILE)
        end = tl.max(tl.where(rm, last, 0)) + 1
        first = tl.where(window > 0, tl.maximum(tl.min(tl.where(rm, qpos, end)) - window + 1, 0), 0)
        lo = (first // TILE) * TILE
        share = tl.cdiv(tl.cdiv(end - lo, TILE), SPLITS) * TILE  # keys of each split
        a = lo + tl.program_id(2) * share
        b = tl.minimum(end, a + share)
        for kstart in range(a, b, TILE):
            pos = kstart + t
            pm = pos < end
            blk = tl.load(LINE + pos // BLOCK, mask=pm, other=0)
            base = blk.to(tl.int64) * skb + (pos % BLOCK) * skt + h * skh
            kv_mask = pm[:, None] & dm[None, :]
            k = tl.load(K + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
            if SOFTCAP:
                s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
            s = s * 1.4426950408889634
            seen = (pos[None, :] <= last[:, None]) & pm[None, :]
            if window > 0:
                seen = seen & (pos[None, :] > qpos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a row that sees nothing in this tile yet)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        if SPLITS == 1:
            out = acc / l_i[:, None]
            tl.store(O + i[:, None] * soi + heads[:, None] * soh + d[None, :], out.to(O.dtype.element_ty),
                     mask=rm[:, None] & dm[None, :])
        else:  # this split's share: its sums and its maximum, joined by the caller
            at = (tl.program_id(2) * tl.num_programs(0) + h) * (G * W) + r
            tl.store(PART + at[:, None] * DP + d[None, :], acc, mask=rm[:, None])
            tl.store(ML + at, m_i, mask=rm)
            tl.store(ML + SPLITS * tl.num_programs(0) * G * W + at, l_i, mask=rm)

    return paged_piece
