"""A long prompt's piece's attention read straight from the paged pool (Triton).

A piece of ``W`` positions of one row attends over that row's positions up to each query's own:
its earlier positions, already in the pool, and its own, which its layers write there first.
Gathered into a span bucket for PyTorch's attention under a mask (as :mod:`.layers` does where
this kernel cannot run), it pays for the gather, for every masked and padded key, and for a
kernel that spreads 128 queries over few blocks of work: on a Llama-3-8B shape 5.3 ms of a
piece's 14.6 (``benchmarks/diagnostics/piece_profile.py``). Here each program takes one key
head and a tile of its query rows (the group's query heads times the piece's positions, as the
batch's fold lays them out), walks the row's line of the block table a tile of positions at a
time, only as far as its last query sees, with an online softmax; the tiles of keys that all
its queries see whole first, with no mask. Where a piece's tiles of query rows are fewer than
the GPU's multiprocessors (a piece of 128 beside decoding rows), four programs share each, each
over a quarter of its keys, and a second kernel joins their partial sums (one program a tile
left most of an H200's SMs idle: 1.15 ms of attention a piece on that shape, against 5.3
gathered). The piece's place (start, valid positions, row) is read from the
device, so one graph of the piece's width serves any place and any length. The kernels' source
is :mod:`._piece_triton`.
"""

import math
from typing import Optional

import torch

from ... import _compat
from .paged_attention import read_back

Tensor = torch.Tensor
TILE = 64  # key positions a program reads at a time
ROWS = 64  # query rows (heads of a group x positions) a program takes
SPLITS = 4  # programs sharing a tile of query rows, each over a quarter of its keys, where
# the tiles are fewer than the GPU's multiprocessors (a piece beside decoding rows); else one
STAGES = 2  # loads in flight in a program's loop
WIDE = dict(rows=128, warps=8, stages=4, splits=1)  # ... where the tiles of ROWS fill the GPU, heads of 128 at most
# (the fastest over 1,024-8,192 keys of the Llama-3-8B shape on an H200, in a graph, with
# ``benchmarks/diagnostics/piece_attention.py --tune [--width 512]``: a piece of 128, 0.049 ms
# over 4,096 keys, 0.108 without splits; a piece of 512, 0.098 ms, 0.109 with ROWS and no
# splits, 0.150 and 0.177 with four before the tiles seen whole went unmasked)


def attend_piece(query: Tensor, k_pool: Tensor, v_pool: Tensor, line: Tensor, at: Tensor,
                 scale: Optional[float] = None, window: Optional[int] = None,
                 softcap: Optional[float] = None, fp8_scales=None) -> Tensor:
    """``query [1, hq, W, d]`` of a piece at ``at = (start, valid, row)`` (a device tensor) over
    its row's blocks ``line`` in the pools ``[blocks, block, hkv, d]`` -> ``[1, W, hq, d]``.
    Query ``i`` sees positions up to ``start + min(i, valid - 1)`` (a padding query sees what
    the last valid one sees); with ``window``, only after ``start + i - window``; with
    ``softcap``, scores are ``softcap * tanh(s / softcap)``; with ``fp8_scales`` (the layer's
    :class:`~..cache.fp8.Scales`), the pools are FP8, read back times their scales."""
    d = query.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    ks, vs = (float(fp8_scales.keys), float(fp8_scales.values)) if fp8_scales is not None else (1.0, 1.0)
    if not query.is_cuda:  # (off a GPU: the torch reference, what the batch's tests read the pool in place with)
        return reference(query, k_pool, v_pool, line, at, scale, window, softcap, ks, vs)
    return _launch(query[0], k_pool, v_pool, line, at, scale, int(window or 0), float(softcap or 0.0),
                   k_scale=ks, v_scale=vs, **_shape_of_work(query, k_pool))[None]


def _shape_of_work(query: Tensor, k_pool: Tensor) -> dict:
    """:data:`WIDE` where a piece's tiles of :data:`ROWS` query rows are at least the GPU's
    multiprocessors (a piece of 512 alone), else :data:`SPLITS` programs to each tile."""
    _, hq, width, d = query.shape
    hkv = k_pool.shape[2]
    if hkv * -(-(hq // hkv) * width // ROWS) < _compat.multiprocessors(query.device):
        return {"splits": SPLITS}
    return WIDE if d <= 128 else {"splits": 1}


def _launch(q: Tensor, k_pool: Tensor, v_pool: Tensor, line: Tensor, at: Tensor, scale: float, window: int,
            softcap: float, rows: int = ROWS, tile: int = TILE, warps: int = 4, stages: Optional[int] = STAGES,
            splits: int = SPLITS, k_scale: float = 1.0, v_scale: float = 1.0) -> Tensor:
    """The kernel over ``q [hq, W, d]`` -> ``[W, hq, d]`` (``rows``, ``tile``, ``warps``, ``stages``,
    ``splits``: its shape of work, for ``benchmarks/diagnostics/piece_attention.py --tune``; with
    ``splits``, each tile of query rows is taken by that many programs, each over its share of the
    keys, and their partial sums are joined here)."""
    import triton

    hq, width, d = q.shape
    block, hkv = k_pool.shape[1], k_pool.shape[2]
    group = hq // hkv
    assert splits & (splits - 1) == 0, "splits: a power of two"
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
        q, k_pool, v_pool, line, at, out, part, ml, scale * k_scale, v_scale, window, softcap,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        out.stride(0), out.stride(1),
        G=group, W=width, D=d, DP=dp, BLOCK=block, TILE=tile, ROWS=rows, SPLITS=splits,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", SOFTCAP=bool(softcap), num_warps=warps, **extra)
    if splits > 1:  # the splits' partial sums joined: each weighed by its share of the softmax's total
        _joiner()[(hkv * group * width,)](part, ml, out, out.stride(0), out.stride(1), G=group, W=width, D=d, DP=dp,
                                          SPLITS=splits, num_warps=1)
    return out


def reference(query: Tensor, k_pool: Tensor, v_pool: Tensor, line: Tensor, at: Tensor,
              scale: Optional[float] = None, window: Optional[int] = None, softcap: Optional[float] = None,
              k_scale: float = 1.0, v_scale: float = 1.0) -> Tensor:
    """What :func:`attend_piece` computes, in torch (the row gathered, each query masked; an FP8
    pool's keys and values read back with their scales): for tests."""
    _, hq, width, d = query.shape
    block, hkv = k_pool.shape[1], k_pool.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    start, valid = int(at[0]), int(at[1])
    end = start + valid  # (no query sees past its last valid position: what lies there may be anything)
    blocks = line[:-(-end // block)]
    k = k_pool[blocks].flatten(0, 1)[:end].transpose(0, 1).repeat_interleave(hq // hkv, 0).float()  # [hq, end, d]
    v = v_pool[blocks].flatten(0, 1)[:end].transpose(0, 1).repeat_interleave(hq // hkv, 0).float()
    k, v = read_back(k, k_scale, query.dtype), read_back(v, v_scale, query.dtype)
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


def _kernel():
    from ._piece_triton import paged_piece

    return paged_piece


def _joiner():
    from ._piece_triton import join_splits

    return join_splits
