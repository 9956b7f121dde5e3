"""Llama's gated MLP's first half in one kernel: ``silu(x @ gate.T) * (x @ up.T)`` (Triton).

transformers' ``LlamaMLP`` (and the families that copy it: Mistral, Qwen2, ...) runs the gate's
and the up projection's matrix products, then SiLU, then their product: four kernels, two of
them over the activations a second time. On a decode step there are few rows (the step's, 64 at
most here), so the products are bound by reading the weights; one program here takes ``BN`` of
the outputs for every row, reads those rows of both weights once, and applies SiLU and the
product before it writes. Each intermediate is rounded to the activations' dtype where
transformers rounds it (the products, then SiLU), so the result equals theirs to the order of the
products' sums. Taken where the batch's step kernels run (a GPU with Triton), for fp16 and bf16,
with no biases, and rows no more than :data:`ROWS`; elsewhere the module's own forward.
"""

import functools
from typing import Optional, Tuple

import torch

from ... import _compat
from . import paged_attention, qkv

Tensor = torch.Tensor
ROWS = 64  # at most this many rows (the step's); wider inputs (a prompt's positions) are cuBLAS's
STAGES = 4
# The shape of work by card (``step_products.py --tune``): outputs a program takes, the inner
# dimension's step, warps. A card whose name holds a key takes its row; any other the H200's
# (:func:`by_outputs`, 64, 4). On an H100 (SXM, HBM3) tiles of 64 by 128 in 8 warps were the
# fastest for both the 1.1B and the 7-8B shape (20.8 and 87.6 us against 21.6 and 92.2 for the
# H200's choice); on an H200 that choice was 4-6% slower than its own.
CARDS = {"H100 80GB HBM3": (64, 128, 8)}


def applies(x: Tensor, gate: torch.nn.Linear, up: torch.nn.Linear) -> bool:
    """Whether :func:`gate_up` takes ``x [..., K]`` through these projections."""
    if not (qkv.plain(gate, x) and qkv.plain(up, x)):
        return False
    wg, wu = gate.weight, up.weight
    return (x.is_cuda and not torch.compiler.is_compiling() and paged_attention.available()
            and gate.bias is None and up.bias is None and x.dtype in (torch.float16, torch.bfloat16)
            and wg.dtype == wu.dtype == x.dtype and wg.shape == wu.shape and wg.shape[1] == x.shape[-1]
            and wg.stride(-1) == 1 and wu.stride(-1) == 1 and wg.stride() == wu.stride()
            and x.numel() // x.shape[-1] <= ROWS)


def by_outputs(n: int, device: torch.device) -> int:
    """Outputs a program takes: 64 where that still makes a program for each SM (the 7-8B shape's
    14,336 outputs: 63.5 us, against 73-87 in tiles of 16 or 32), else 16 (the 1.1B shape's 5,632
    in 88 tiles of 64 left SMs idle: 17.9 us in tiles of 16, 19.3 in tiles of 64)."""
    return 64 if -(-n // 64) >= _compat.multiprocessors(device) else 16


@functools.lru_cache(maxsize=None)
def _card(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def shape_of_work(n: int, device: torch.device) -> Tuple[int, int, int]:
    """``(BN, BK, warps)`` for ``n`` outputs on ``device``'s card (:data:`CARDS`)."""
    name = _card(device)
    for key, shape in CARDS.items():
        if key in name:
            return shape
    return by_outputs(n, device), 64, 4


def gate_up(x: Tensor, wg: Tensor, wu: Tensor, bn: Optional[int] = None, bk: Optional[int] = None,
            warps: Optional[int] = None, stages: int = STAGES) -> Tensor:
    """``silu(x @ wg.T) * (x @ wu.T)`` for ``x [..., K]`` and weights ``[N, K]`` -> ``[..., N]``
    (``bn``, ``bk``, ``warps``, ``stages``: the kernel's shape of work, for the tune; None: the
    card's, :func:`shape_of_work`)."""
    import triton

    from ._mlp_triton import gate_up as kernel

    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    n = wg.shape[0]
    bn, bk, warps = (c if v is None else v for v, c in zip((bn, bk, warps), shape_of_work(n, x.device)))
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm = max(16, 1 << (m - 1).bit_length())
    kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
        rows, wg, wu, out, m, n, k, rows.stride(0), wg.stride(0), out.stride(0),
        BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    return out.view(*x.shape[:-1], n)


def reference(x: Tensor, wg: Tensor, wu: Tensor) -> Tensor:
    """What transformers computes: the products, SiLU and their product, each in ``x``'s dtype."""
    return torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)
