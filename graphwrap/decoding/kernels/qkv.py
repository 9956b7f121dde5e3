"""A decode step's query, key and value projections in one kernel (Triton).

On a step the projections' matrix products have few rows (64 at most here) and are bound by
reading the weights; cuBLAS takes them one launch each, and the key's and value's (grouped
heads: a few hundred outputs) through a split-K kernel and its reduction: on the 1.1B Llama
shape's 64-row step (an H200) the three took 17 us a layer for 10.5 MB of weights, against 2 us
at the bandwidth (``benchmarks/diagnostics/step_profile.py --ops``). Here one launch takes all
three: its programs are the tiles of the query's outputs, then the key's, then the value's, each
summing in fp32 and rounding once (with the bias, where the projections have one), as cuBLAS
does to the order of its sums. Where those tiles are fewer than the chip's SMs (the 1.1B shape's
80 on an H200's 132), the inner dimension goes in two parts, a program each, and a second kernel
adds the two in order and rounds (11.2 -> 8.9 us a layer; ``step_products.py --tune``).

The attention module's own ``forward`` still runs: it is handed :class:`Given`, the module as it
is but for its three projections, which give the products already made for the very tensor
they were made from (any other input goes to the projection itself).
"""

from typing import List, Optional, Sequence

import torch

from ... import _compat
from . import paged_attention

Tensor = torch.Tensor
ROWS = 64  # at most this many rows (a step's); wider inputs (a prompt's positions) are cuBLAS's
BN, BK, WARPS, STAGES = 32, 64, 4, 4  # shape of work: step_products.py --tune, H200
SPLIT = None  # parts of the inner dimension (None: two where the tiles are fewer than the chip's SMs)
REDUCE_BN = 256  # outputs a program of the sum takes
NAMES = ("q_proj", "k_proj", "v_proj")


def plain(linear, x: Tensor) -> bool:
    """Whether ``linear`` is an ``nn.Linear`` whose call is its product alone (no hooks of its own
    or global ones: an adapter's, an offloading's), its weight a plain tensor (not a quantized
    subclass, whose memory is not the matrix) on ``x``'s device."""
    from torch.nn.modules import module as m

    tensors = (torch.nn.Parameter, torch.Tensor)
    return (type(linear) is torch.nn.Linear and type(linear.weight) in tensors
            and (linear.bias is None or type(linear.bias) in tensors) and linear.weight.device == x.device
            and not (linear._forward_hooks or linear._forward_pre_hooks or m._global_forward_hooks
                     or m._global_forward_pre_hooks))


def applies(x: Tensor, projections: Sequence) -> bool:
    """Whether :func:`project` takes ``x [..., K]`` through these three ``nn.Linear``."""
    if len(projections) != 3 or not all(plain(p, x) for p in projections):
        return False
    ws = [p.weight for p in projections]
    biased = [p.bias is not None for p in projections]
    return (x.is_cuda and not torch.compiler.is_compiling() and paged_attention.available()
            and x.dtype in (torch.float16, torch.bfloat16) and all(w.dtype == x.dtype for w in ws)
            and all(w.dim() == 2 and w.shape[1] == x.shape[-1] and w.stride(-1) == 1 for w in ws)
            and len(set(biased)) == 1 and all(p.bias is None or p.bias.dtype == x.dtype for p in projections)
            and x.numel() // x.shape[-1] <= ROWS)


def project(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]], bn: int = BN, bk: int = BK,
            warps: int = WARPS, stages: int = STAGES, split: Optional[int] = SPLIT) -> List[Tensor]:
    """``[x @ w.T + b for w, b in zip(weights, biases)]`` (one to three; biases all or none) for
    ``x [..., K]`` -> ``[..., N_i]`` each, in one launch (``bn``, ``bk``, ``warps``, ``stages``: its
    shape of work). With ``split`` > 1 the inner dimension goes in that many parts, each a program
    of its own, summed in fp32 by a second kernel in their order (the same result every run)."""
    import triton

    from ._qkv_triton import project as kernel
    from ._qkv_triton import reduce

    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    assert m <= ROWS, "one tile of rows: a step's"
    assert 1 <= len(weights) == len(biases) <= 3, "one to three products"
    made = len(weights)
    ns = [w.shape[0] for w in weights] + [0] * (3 - made)  # (a product of no outputs: no tiles, never read)
    weights = list(weights) + [weights[0]] * (3 - made)
    biases = list(biases) + [biases[0]] * (3 - made)
    outs = [torch.empty((m, n), dtype=x.dtype, device=x.device) for n in ns]
    tiles = [triton.cdiv(n, bn) for n in ns]
    if split is None:  # (the 1.1B shape's 80 tiles on an H200's 132 SMs: 11.2 -> 8.9 us with two)
        split = 2 if sum(tiles) < _compat.multiprocessors(x.device) else 1
    has_bias = biases[0] is not None
    b = list(biases) if has_bias else [weights[0]] * 3  # (never read without biases)
    ks = triton.cdiv(triton.cdiv(k, split), bk) * bk  # each part a whole number of steps
    split = triton.cdiv(k, ks)
    parts = torch.empty((split, m, sum(ns)), dtype=torch.float32, device=x.device) if split > 1 else outs[0]
    kernel[(sum(tiles), split)](
        rows, *weights, *b, *outs, parts, m, *ns, k, ks, rows.stride(0), *(w.stride(0) for w in weights),
        *(o.stride(0) for o in outs), parts.stride(-2), parts.stride(0), tiles[0], tiles[1],
        HAS_BIAS=has_bias, SPLIT=split, BM=max(16, 1 << (m - 1).bit_length()), BN=bn, BK=bk, num_warps=warps,
        num_stages=stages)
    if split > 1:
        reduce[(m, triton.cdiv(sum(ns), REDUCE_BN))](
            parts, *b, *outs, *ns, *(o.stride(0) for o in outs), parts.stride(1), parts.stride(0),
            HAS_BIAS=has_bias, SPLIT=split, BN=REDUCE_BN)
    return [o.view(*x.shape[:-1], n) for o, n in zip(outs[:made], ns)]




def reference(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]]) -> List[Tensor]:
    """What the three projections compute, one by one."""
    return [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases)]


class _Made:
    """A projection that gives ``out`` for ``x`` itself (and is the projection for anything else)."""

    def __init__(self, linear, x: Tensor, out: Tensor):
        self._linear, self._x, self._out = linear, x, out

    def __call__(self, x: Tensor) -> Tensor:
        return self._out if x is self._x else self._linear(x)

    def __getattr__(self, name):
        return getattr(self._linear, name)


class Given:
    """An attention module as it is, but for its query, key and value projections, which give the
    products already made for ``x``."""

    def __init__(self, module, x: Tensor, outs: Sequence[Tensor]):
        made = {n: _Made(getattr(module, n), x, o) for n, o in zip(NAMES, outs)}
        object.__setattr__(self, "_gw_module", module)
        object.__setattr__(self, "_gw_made", made)

    def __getattr__(self, name):
        made = object.__getattribute__(self, "_gw_made")
        if name in made:
            return made[name]
        return getattr(object.__getattribute__(self, "_gw_module"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_gw_module"), name, value)
