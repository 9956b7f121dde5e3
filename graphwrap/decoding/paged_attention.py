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


def attend(query: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, lengths: Tensor,
           scale: Optional[float] = None, window: Optional[int] = None, softcap: Optional[float] = None) -> Tensor:
    """``query [n, hq, 1, d]`` over each row's first ``lengths[i]`` positions of the pools
    ``[blocks, block, hkv, d]`` (row ``i``'s blocks in ``table[i]``) -> ``[n, 1, hq, d]``. With
    ``window``, only the last ``window`` positions (transformers' sliding window: the query at
    ``p`` sees keys after ``p - window``); with ``softcap``, scores are ``softcap * tanh(s /
    softcap)`` (Gemma 2). An operator of torch's own (``graphwrap::paged_attend``), so that
    ``torch.compile`` calls the kernel as it is, around what it compiles (Inductor could not
    compile the kernel's source into its own)."""
    d = query.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return paged_attend(query[:, :, 0], k_pool, v_pool, table, lengths, scale, int(window or 0),
                        float(softcap or 0.0))[:, None]


def _launch(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, lengths: Tensor, scale: float, window: int,
            softcap: float, tile: Optional[int] = None, warps: Optional[int] = None,
            stages: Optional[int] = None) -> Tensor:
    """The kernel over ``q [n, hq, d]`` -> ``[n, hq, d]`` (``tile``, ``warps``, ``stages``: its
    shape of work, ``shape_of_work(d)``'s unless given, for ``step_attention.py --tune``)."""
    n, hq, d = q.shape
    if tile is None:
        tile, warps, stages = shape_of_work(d)
    warps = 4 if warps is None else warps
    block, hkv = k_pool.shape[1], k_pool.shape[2]
    group = hq // hkv
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    _kernel()[(n, hkv)](
        q, k_pool, v_pool, table, lengths, out, scale, window, softcap,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), table.stride(0),
        out.stride(0), out.stride(1),
        G=group, GP=max(16, _pow2(group)), D=d, DP=max(16, _pow2(d)), BLOCK=block, TILE=tile,
        IEEE=q.dtype == torch.float32, SOFTCAP=bool(softcap), num_warps=warps,
        **({} if stages is None else {"num_stages": stages}))
    return out


@torch.library.custom_op("graphwrap::paged_attend", mutates_args=())
def paged_attend(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, lengths: Tensor, scale: float,
                 window: int, softcap: float) -> Tensor:
    """``_launch`` as torch's operator ``graphwrap::paged_attend`` (off a GPU, :func:`reference`:
    what the batch's tests read the pool in place with on a CPU)."""
    if not q.is_cuda:
        return reference(q[:, :, None], k_pool, v_pool, table, lengths, scale, window, softcap)[:, 0]
    return _launch(q, k_pool, v_pool, table, lengths, scale, window, softcap)


@paged_attend.register_fake
def _(q, k_pool, v_pool, table, lengths, scale, window, softcap):
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
