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

from ... import _compat

Tensor = torch.Tensor
TILE = 64  # positions a program reads at a time (heads wider than 128)
SPLIT_FROM = 1024  # a step's graph over rows past this many positions splits each row's positions
SPLITS = 16  # programs a row's positions are split between at most, in such a graph
PER_SM = 4  # in such a graph, programs an SM a step's rows are split into at most (work_of)


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


def splits_at(splits: int, rows: int, key_heads: int, device: torch.device) -> int:
    """The programs each row's positions go to in a step of ``rows`` rows: the window's
    ``splits`` (:func:`splits_for`) where it splits; else, where the rows' programs (one a row
    and key head) leave the SMs idle, 8 where they are a quarter of the SMs at most and 4 where
    they are as many at most. On an H200, 32 query heads over 8 of 128 (``step_attention.py
    --splits``): one row at 256, 512 and 1,024 positions in 8, 6.8, 8.4 and 9.7 us against 8.5,
    14.1 and 26.0 unsplit (at 128 positions, two tiles, 5.8 against 5.0); 16 rows at 512 and
    1,024 positions in 4, 12.1 and 24.4 us against 15.8 and 38.6 (at 128, 7.8 against 5.8)."""
    programs = rows * key_heads
    if splits > 1 or device.type != "cuda":
        return splits
    sms = _compat.multiprocessors(device)
    return 8 if 4 * programs <= sms else 4 if programs <= sms else 1


def balances(rows: int, key_heads: int, device: torch.device) -> bool:
    """Whether a step of ``rows`` rows whose window splits them balances its rows by
    :func:`work_of`: where the rows' programs (one a row and key head) are more than a quarter of
    the SMs. Fewer (one to four rows of 8 key heads on an H200) keep the window's split as it is:
    one row of 4,096 positions took 12.5 us either way (``step_attention.py --splits``)."""
    return 4 * rows * key_heads > _compat.multiprocessors(device)


def work_of(seen: Tensor, d: int, window: Optional[int] = None) -> Tensor:
    """Every row's tiles of positions summed (``seen``: the positions each row sees; ``d``: the
    heads' width, which sets the tile; ``window``: a sliding window's), as one number on the
    device: what a graph whose rows split past :data:`SPLIT_FROM` divides between about
    :data:`PER_SM` programs an SM, so that rows of equal length are split only as far as the SMs
    need (at 256 rows of 2,048 positions, 16 programs a row took 577 us against 495 in one, on
    an H200), while one long row beside short ones still spreads over up to :data:`SPLITS`. The
    programs a row leaves unused still start (the grid is the graph's) but leave before any read:
    balanced, that step took 517 us against 569 when they read their row's query first
    (``benchmarks/results/h200-2026-12-01-burst/``)."""
    tile = shape_of_work(d)[0]
    lo = (seen - window).clamp(min=0) // tile * tile if window else 0
    return ((seen - lo + (tile - 1)) // tile).clamp(min=1).sum()


def attend(query: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, lengths: Tensor,
           scale: Optional[float] = None, window: Optional[int] = None, softcap: Optional[float] = None,
           splits: int = 1, fp8_scales=None, work: Optional[Tensor] = None) -> Tensor:
    """``query [n, hq, 1, d]`` over each row's first ``lengths[i]`` positions of the pools
    ``[blocks, block, hkv, d]`` (row ``i``'s blocks in ``table[i]``) -> ``[n, 1, hq, d]``. With
    ``window``, only the last ``window`` positions (transformers' sliding window: the query at
    ``p`` sees keys after ``p - window``); with ``softcap``, scores are ``softcap * tanh(s /
    softcap)`` (Gemma 2). With ``splits`` above 1, each row's positions go to up to that many
    programs (as many as make tiles of their own), and a second kernel joins their parts; with
    ``work`` (:func:`work_of` of ``lengths``), each row's programs take at least the step's share
    of its tiles. With
    ``fp8_scales`` (the layer's :class:`~..cache.fp8.Scales`), the pools are FP8: a key reads
    back as its stored value times ``fp8_scales.keys``, a value times ``fp8_scales.values``. An
    operator of torch's own (``graphwrap::paged_attend``), so that ``torch.compile`` calls the
    kernel as it is, around what it compiles (Inductor could not compile the kernel's source
    into its own)."""
    d = query.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    ks, vs = (float(fp8_scales.keys), float(fp8_scales.values)) if fp8_scales is not None else (1.0, 1.0)
    return paged_attend(query[:, :, 0], k_pool, v_pool, table, lengths, scale, int(window or 0),
                        float(softcap or 0.0), int(splits), ks, vs, work if splits > 1 else None)[:, None]


def _launch(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, lengths: Tensor, scale: float, window: int,
            softcap: float, tile: Optional[int] = None, warps: Optional[int] = None,
            stages: Optional[int] = None, splits: int = 1, k_scale: float = 1.0, v_scale: float = 1.0,
            work: Optional[Tensor] = None) -> Tensor:
    """The kernel over ``q [n, hq, d]`` -> ``[n, hq, d]`` (``tile``, ``warps``, ``stages``: its
    shape of work, ``shape_of_work(d)``'s unless given, for ``step_attention.py --tune``;
    ``splits``: programs a row's positions go to at most, their parts joined by a second kernel;
    ``work``: :func:`work_of`, the rows split by the step's share of the SMs)."""
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
    scale = scale * k_scale  # (the keys' FP8 scale: the scores'; the values' scales the output)
    if splits <= 1:
        _triton().paged_decode[(n, hkv)](*args, out, scale, v_scale, window, softcap, *strides, out.stride(0),
                                         out.stride(1), **shape)
        return out
    parts = torch.empty((n, hkv, splits, gp, dp + 2), dtype=torch.float32, device=q.device)  # each part's sums, max
    balance = work is not None
    target = PER_SM * _compat.multiprocessors(q.device) if balance else 1
    w = work if balance else lengths  # (read only where balanced)
    _triton().paged_decode_part[(n, hkv, splits)](*args, parts, w, target, scale, window, softcap, *strides, S=splits,
                                                  BALANCE=balance, **shape)
    _triton().paged_decode_join[(n, hkv)](lengths, parts, out, w, target, v_scale, window, out.stride(0),
                                          out.stride(1), G=group, GP=gp, GJ=_pow2(group), D=d, DP=dp, TILE=tile,
                                          S=splits, BALANCE=balance, num_warps=4)
    return out


@torch.library.custom_op("graphwrap::paged_attend", mutates_args=())
def paged_attend(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, lengths: Tensor, scale: float,
                 window: int, softcap: float, splits: int = 1, k_scale: float = 1.0, v_scale: float = 1.0,
                 work: Optional[Tensor] = None) -> Tensor:
    """``_launch`` as torch's operator ``graphwrap::paged_attend`` (off a GPU, :func:`reference`:
    what the batch's tests read the pool in place with on a CPU)."""
    if not q.is_cuda:
        return reference(q[:, :, None], k_pool, v_pool, table, lengths, scale, window, softcap, k_scale,
                         v_scale)[:, 0]
    return _launch(q, k_pool, v_pool, table, lengths, scale, window, softcap, splits=splits, k_scale=k_scale,
                   v_scale=v_scale, work=work)


@paged_attend.register_fake
def _(q, k_pool, v_pool, table, lengths, scale, window, softcap, splits=1, k_scale=1.0, v_scale=1.0, work=None):
    return q.new_empty(q.shape)


def reference(query: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, lengths: Tensor,
              scale: Optional[float] = None, window: Optional[int] = None, softcap: Optional[float] = None,
              k_scale: float = 1.0, v_scale: float = 1.0) -> Tensor:
    """What :func:`attend` computes, in torch (each row gathered and attended alone, an FP8
    pool's keys and values read back with their scales): for tests."""
    n, hq, _, d = query.shape
    block, hkv = k_pool.shape[1], k_pool.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = []
    for i in range(n):
        L = int(lengths[i])
        lines = table[i, :-(-L // block)]
        k = k_pool[lines].flatten(0, 1)[:L].transpose(0, 1).repeat_interleave(hq // hkv, 0).float()  # [hq, L, d]
        v = v_pool[lines].flatten(0, 1)[:L].transpose(0, 1).repeat_interleave(hq // hkv, 0).float()
        k, v = read_back(k, k_scale, query.dtype), read_back(v, v_scale, query.dtype)
        s = (query[i].float() @ k.transpose(1, 2)) * scale  # [hq, 1, L]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if window:
            s[..., :max(0, L - window)] = float("-inf")
        out.append((s.softmax(-1) @ v).to(query.dtype))
    return torch.stack(out).transpose(1, 2)


def read_back(x: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """Positions gathered in fp32 from a pool, times the layer's scale (1 for a pool of the
    model's dtype: unchanged), in the model's dtype, as the batch's gathered windows read them."""
    return (x * scale).to(dtype).float()


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _triton():
    """The kernels' module (:mod:`._paged_triton`), imported the first time a kernel runs."""
    from . import _paged_triton

    return _paged_triton
