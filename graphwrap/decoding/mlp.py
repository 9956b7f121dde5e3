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

from typing import Optional, Tuple

import torch

from . import paged_attention, qkv

Tensor = torch.Tensor
ROWS = 64  # at most this many rows (the step's); wider inputs (a prompt's positions) are cuBLAS's
BN, BK, WARPS, STAGES = 64, 64, 8, 4  # shape of work: step_products.py --tune, H200
SPLIT = 1  # parts of the inner dimension (more programs; a second kernel sums them)
FINISH_BN = 256  # outputs a program of the sum takes


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


def gate_up(x: Tensor, wg: Tensor, wu: Tensor, bn: int = BN, bk: int = BK, warps: int = WARPS,
            stages: int = STAGES, split: int = SPLIT, norm: Optional[Tuple[Tensor, float]] = None) -> Tensor:
    """``silu(x @ wg.T) * (x @ wu.T)`` for ``x [..., K]`` and weights ``[N, K]`` -> ``[..., N]``
    (``bn``, ``bk``, ``warps``, ``stages``: the kernel's shape of work, for the tune). With
    ``split`` > 1 the inner dimension goes in that many parts, each a program of its own, summed
    in fp32 by a second kernel in their order (the same result every run), which applies SiLU
    and the product. With ``norm`` (an RMSNorm's weight and epsilon), of ``rms_norm(x)`` instead,
    never written."""
    import triton

    from ._mlp_triton import finish
    from ._mlp_triton import gate_up as kernel

    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    n = wg.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm = max(16, 1 << (m - 1).bit_length())
    ks = triton.cdiv(triton.cdiv(k, split), bk) * bk  # each part a whole number of steps
    split = triton.cdiv(k, ks)
    parts = torch.empty((split, m, 2 * n), dtype=torch.float32, device=x.device) if split > 1 else out
    nw, eps = (wg, 0.0) if norm is None else norm
    kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm), split)](
        rows, wg, wu, out, parts, nw, float(eps), m, n, k, ks, rows.stride(0), wg.stride(0), out.stride(0),
        parts.stride(-2), parts.stride(0), HAS_NORM=norm is not None, SPLIT=split, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    if split > 1:
        finish[(m, triton.cdiv(n, FINISH_BN))](parts, out, n, out.stride(0), parts.stride(1), parts.stride(0),
                                                SPLIT=split, BN=FINISH_BN)
    return out.view(*x.shape[:-1], n)


def reference(x: Tensor, wg: Tensor, wu: Tensor, norm: Optional[Tuple[Tensor, float]] = None) -> Tensor:
    """What transformers computes: the products, SiLU and their product, each in ``x``'s dtype (of
    ``rms_norm(x)`` with ``norm``)."""
    if norm is not None:
        x = torch.nn.functional.rms_norm(x, (x.shape[-1],), norm[0], norm[1])
    return torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)
