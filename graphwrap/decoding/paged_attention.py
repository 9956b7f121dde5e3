"""A decode step's attention read straight from the paged pool, each row over its own positions.

With one query position per row, a row's attention reads its keys and values once: the kernel
here walks the row's line of the block table, a tile of positions at a time, with an online
softmax (one program per row and key head; the query heads of a key head's group are rows of
one matrix product). Nothing is gathered and no row reads past its own length, so a step's
attention costs the live positions, not rows x the longest. A Triton kernel: used on CUDA
devices where Triton imports (it comes with PyTorch's CUDA wheels); elsewhere the step gathers
each row's blocks for the model's own attention (:mod:`.layers`).
"""

import functools
import math
from typing import Optional

import torch

Tensor = torch.Tensor
TILE = 64  # positions a program reads at a time (heads wider than 128)
SPLIT_FROM = 1024  # a step's graph over rows past this many positions splits each row's positions
SPLITS = 16  # programs a row's positions are split between at most, in such a graph


def shape_of_work(d: int) -> tuple:
    """The kernel's (tile of positions, warps, stages) for heads ``d`` wide: the fastest found by
    ``benchmarks/diagnostics/step_attention.py --tune`` on an H200 over 64 rows at 192-4,096
    positions (64-wide heads: tile 128, 4 warps, 2 stages, 1.1-1.5x the earlier tile 64 and 4
    warps; 128-wide: tile 64, 2 warps, 2 stages, up to 1.15x). Wider heads keep the earlier shape."""
    if d <= 64:
        return 128, 4, 2
    if d <= 128:
        return 64, 2, 2
    return TILE, 4, None


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the kernel can run here (Triton imports and a CUDA device is present)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def splits_for(span: int) -> int:
    """Programs a row's positions are split between in a step's graph over ``span`` positions:
    one up to :data:`SPLIT_FROM` (short rows: as fast one program a row and key head, and no
    second kernel), else :data:`SPLITS`. Without the split, one row of 6,000 positions beside 32
    of 200 held a Llama-3-8B step's attention at 6.3 ms against 1.0: every row waited for the
    longest (``benchmarks/results/h200-2026-11-27-mixed-overlap/``)."""
    return 1 if span <= SPLIT_FROM else SPLITS


def attend(query: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, lengths: Tensor,
           scale: Optional[float] = None, window: Optional[int] = None, softcap: Optional[float] = None,
           splits: int = 1) -> Tensor:
    """``query [n, hq, 1, d]`` over each row's first ``lengths[i]`` positions of the pools
    ``[blocks, block, hkv, d]`` (row ``i``'s blocks in ``table[i]``) -> ``[n, 1, hq, d]``. With
    ``window``, only the last ``window`` positions (transformers' sliding window: the query at
    ``p`` sees keys after ``p - window``); with ``softcap``, scores are ``softcap * tanh(s /
    softcap)`` (Gemma 2). With ``splits`` above 1, each row's positions go to up to that many
    programs (as many as make tiles of their own), and a second kernel joins their parts. An
    operator of torch's own (``graphwrap::paged_attend``), so that ``torch.compile`` calls the
    kernel as it is, around what it compiles (Inductor could not compile the kernel's source
    into its own)."""
    d = query.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return paged_attend(query[:, :, 0], k_pool, v_pool, table, lengths, scale, int(window or 0),
                        float(softcap or 0.0), int(splits))[:, None]


def _launch(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, lengths: Tensor, scale: float, window: int,
            softcap: float, tile: Optional[int] = None, warps: Optional[int] = None,
            stages: Optional[int] = None, splits: int = 1) -> Tensor:
    """The kernel over ``q [n, hq, d]`` -> ``[n, hq, d]`` (``tile``, ``warps``, ``stages``: its
    shape of work, ``shape_of_work(d)``'s unless given, for ``step_attention.py --tune``;
    ``splits``: programs a row's positions go to at most, their parts joined by a second kernel)."""
    n, hq, d = q.shape
    if tile is None:
        tile, warps, stages = shape_of_work(d)
    warps = 4 if warps is None else warps
    block, hkv = k_pool.shape[1], k_pool.shape[2]
    group = hq // hkv
    gp, dp = max(16, _pow2(group)), max(16, _pow2(d))
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    shape = dict(G=group, GP=gp, D=d, DP=dp, BLOCK=block, TILE=tile, IEEE=q.dtype == torch.float32,
                 SOFTCAP=bool(softcap), num_warps=warps, **({} if stages is None else {"num_stages": stages}))
    args = (q, k_pool, v_pool, table, lengths)
    strides = (q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), table.stride(0))
    if splits <= 1:
        _kernel()[(n, hkv)](*args, out, scale, window, softcap, *strides, out.stride(0), out.stride(1), **shape)
        return out
    parts = torch.empty((n, hkv, splits, gp, dp + 2), dtype=torch.float32, device=q.device)  # each part's sums, max
    _split_kernel()[(n, hkv, splits)](*args, parts, scale, window, softcap, *strides, S=splits, **shape)
    _join_kernel()[(n, hkv)](lengths, parts, out, window, out.stride(0), out.stride(1), G=group, GP=gp, D=d, DP=dp,
                             TILE=tile, S=splits, num_warps=4)
    return out


@torch.library.custom_op("graphwrap::paged_attend", mutates_args=())
def paged_attend(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, lengths: Tensor, scale: float,
                 window: int, softcap: float, splits: int = 1) -> Tensor:
    """``_launch`` as torch's operator ``graphwrap::paged_attend`` (off a GPU, :func:`reference`:
    what the batch's tests read the pool in place with on a CPU)."""
    if not q.is_cuda:
        return reference(q[:, :, None], k_pool, v_pool, table, lengths, scale, window, softcap)[:, 0]
    return _launch(q, k_pool, v_pool, table, lengths, scale, window, softcap, splits=splits)


@paged_attend.register_fake
def _(q, k_pool, v_pool, table, lengths, scale, window, softcap, splits=1):
    return q.new_empty(q.shape)


def reference(query: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, lengths: Tensor,
              scale: Optional[float] = None, window: Optional[int] = None, softcap: Optional[float] = None) -> Tensor:
    """What :func:`attend` computes, in torch (each row gathered and attended alone): for tests."""
    n, hq, _, d = query.shape
    block, hkv = k_pool.shape[1], k_pool.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = []
    for i in range(n):
        L = int(lengths[i])
        lines = table[i, :-(-L // block)]
        k = k_pool[lines].flatten(0, 1)[:L].transpose(0, 1).repeat_interleave(hq // hkv, 0).float()  # [hq, L, d]
        v = v_pool[lines].flatten(0, 1)[:L].transpose(0, 1).repeat_interleave(hq // hkv, 0).float()
        s = (query[i].float() @ k.transpose(1, 2)) * scale  # [hq, 1, L]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if window:
            s[..., :max(0, L - window)] = float("-inf")
        out.append((s.softmax(-1) @ v).to(query.dtype))
    return torch.stack(out).transpose(1, 2)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(Q, K, V, T, L, O, scale, window, softcap, sqb, sqh, skb, skt, skh, stb, sob, soh,
                     G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                     TILE: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        n_pos = tl.load(L + b)
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        gm = g < G
        dm = d < D
        heads = h * G + g
        q = tl.load(Q + b * sqb + heads[:, None] * sqh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        t = tl.arange(0, TILE)
        first = tl.where(window > 0, tl.maximum(n_pos - window, 0), 0)  # a sliding window's first position
        for start in range((first // TILE) * TILE, n_pos, TILE):
            pos = start + t
            pm = (pos < n_pos) & (pos >= first)
            blk = tl.load(T + b * stb + pos // BLOCK, mask=pm, other=0)
            base = blk.to(tl.int64) * skb + (pos % BLOCK) * skt + h * skh
            kv_mask = pm[:, None] & dm[None, :]
            k = tl.load(K + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
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
            v = tl.load(V + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(O + b * sob + heads[:, None] * soh + d[None, :], out.to(O.dtype.element_ty),
                 mask=gm[:, None] & dm[None, :])

    return paged_decode


@functools.lru_cache(maxsize=None)
def _split_kernel():
    """The kernel of a step whose rows' positions are split (:func:`splits_for`): program
    ``(b, h, s)`` reads the ``s``-th of row ``b``'s runs of tiles (a row of few tiles uses as many
    programs as it has tiles) and writes its part: the unscaled sums ``[G, D]``, then the
    softmax's denominator and maximum, per query head."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_part(Q, K, V, T, L, P, scale, window, softcap, sqb, sqh, skb, skt, skh, stb, G: tl.constexpr,
                          GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                          TILE: tl.constexpr, S: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr):
        b, h, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n_pos = tl.load(L + b)
        g, d = tl.arange(0, GP), tl.arange(0, DP)
        gm, dm = g < G, d < D
        heads = h * G + g
        q = tl.load(Q + b * sqb + heads[:, None] * sqh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        t = tl.arange(0, TILE)
        first = tl.where(window > 0, tl.maximum(n_pos - window, 0), 0)
        lo = (first // TILE) * TILE
        tiles = tl.maximum(tl.cdiv(n_pos - lo, TILE), 1)
        per = tl.cdiv(tiles, S)  # tiles a part
        begin = lo + part * per * TILE
        end = tl.minimum(begin + per * TILE, n_pos)
        for start in range(begin, end, TILE):
            pos = start + t
            pm = (pos < n_pos) & (pos >= first)
            blk = tl.load(T + b * stb + pos // BLOCK, mask=pm, other=0)
            base = blk.to(tl.int64) * skb + (pos % BLOCK) * skt + h * skh
            kv_mask = pm[:, None] & dm[None, :]
            k = tl.load(K + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
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
            v = tl.load(V + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        row = ((b * tl.num_programs(1) + h) * S + part) * GP + g  # this part's line of each query head
        ok = begin < n_pos
        tl.store(P + row[:, None] * (DP + 2) + d[None, :], acc, mask=ok & gm[:, None] & dm[None, :])
        tl.store(P + row * (DP + 2) + DP, l_i, mask=ok & gm)
        tl.store(P + row * (DP + 2) + DP + 1, m_i, mask=ok & gm)

    return paged_decode_part


@functools.lru_cache(maxsize=None)
def _join_kernel():
    """Joins a split step's parts (:func:`_split_kernel`): program ``(b, h)`` rescales each part
    of row ``b``'s key head ``h`` to the largest maximum and divides by the summed denominators."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_join(L, P, O, window, sob, soh, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                          DP: tl.constexpr, TILE: tl.constexpr, S: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        n_pos = tl.load(L + b)
        first = tl.where(window > 0, tl.maximum(n_pos - window, 0), 0)
        lo = (first // TILE) * TILE
        tiles = tl.maximum(tl.cdiv(n_pos - lo, TILE), 1)
        parts = tl.cdiv(tiles, tl.cdiv(tiles, S))  # the parts that read a tile
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        gm = g < G
        dm = d < D
        top = ((b * tl.num_programs(1) + h) * S) * GP + g
        m = tl.full([GP], float("-inf"), tl.float32)
        for part in range(0, parts):
            m = tl.maximum(m, tl.load(P + (top + part * GP) * (DP + 2) + DP + 1, mask=gm, other=float("-inf")))
        acc = tl.zeros([GP, DP], tl.float32)
        den = tl.zeros([GP], tl.float32)
        for part in range(0, parts):
            row = top + part * GP
            w = tl.exp(tl.load(P + row * (DP + 2) + DP + 1, mask=gm, other=float("-inf")) - m)
            den += w * tl.load(P + row * (DP + 2) + DP, mask=gm, other=0.0)
            acc += w[:, None] * tl.load(P + row[:, None] * (DP + 2) + d[None, :], mask=gm[:, None] & dm[None, :],
                                        other=0.0)
        out = acc / den[:, None]
        tl.store(O + b * sob + (h * G + g)[:, None] * soh + d[None, :], out.to(O.dtype.element_ty),
                 mask=gm[:, None] & dm[None, :])

    return paged_decode_join
