"""A decode step's RMSNorm in a kernel of graphwrap's (Triton).

On a step the norm's input is a few rows (64 at most here): PyTorch's fused ``rms_norm`` took
3.5 us a call on the 1.1B Llama shape's 64-row step (an H200), 45 calls a step, for 256 KB
read and written each (``benchmarks/diagnostics/step_profile.py``). Here one program takes one
row: it reads the row and the weight once, sums the squares in fp32 and writes
``x * rsqrt(mean + eps) * w`` rounded once, as PyTorch's kernel does (to the order of the sum):
1.64 against 3.16 us at 64 rows of 2,048, 1.93 against 4.77 at 4,096, and the 1.1B step 1.626
-> 1.537 ms (``benchmarks/results/h200-2026-11-27-step-norm/``).
"""

import functools

import torch

from . import paged_attention

Tensor = torch.Tensor
ROWS = 64  # at most this many rows (a step's); more (a prompt's positions) are PyTorch's
WIDEST = 16384  # the widest row one program takes


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`rms` takes ``x [..., n]`` with ``weight [n]``."""
    n = x.shape[-1]
    return (x.is_cuda and not torch.compiler.is_compiling() and paged_attention.available()
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype and weight.dim() == 1
            and weight.shape[0] == n and weight.stride(0) == 1 and weight.device == x.device
            and n <= WIDEST and x.numel() // max(n, 1) <= ROWS)


def rms(x: Tensor, weight: Tensor, eps: float, warps: int = 0) -> Tensor:
    """``weight * x * rsqrt(mean(x^2, -1) + eps)`` in fp32, rounded once (``warps``: the kernel's,
    by the row's width unless given)."""
    from ._norm_triton import rms_norm

    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block = _pow2(n)
    rms_norm[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), n, float(eps), BLOCK=block,
                               num_warps=warps or _warps(block))
    return out.view(x.shape)


def reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """What :func:`rms` computes, in torch (for tests)."""
    f = x.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


@functools.lru_cache(maxsize=None)
def _warps(block: int) -> int:
    return max(1, min(8, block // 512))


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())
