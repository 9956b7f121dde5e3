"""Llama's rotary position embedding of a layer's queries and keys in one kernel (Triton).

transformers' ``apply_rotary_pos_emb`` (Llama's, and the families that copy it: Mistral, Qwen2,
...) is ten kernels a layer: for the queries and for the keys, the product with ``cos``, the
negated half, the halves joined (``rotate_half``), the product with ``sin`` and the sum. On a
decode step the queries are a transposed view and ``cos`` broadcasts over the heads, so each
product runs PyTorch's general elementwise kernel, not its vectorised one: on the 1.1B Llama
shape's 64-row step (an H200) those kernels took some 0.6 ms of its 2.5 ms of kernels
(``benchmarks/diagnostics/step_profile.py``). Here one program takes one position's heads of
both, reads ``cos`` and ``sin`` once, computes in fp32 and rounds once (transformers rounds each
of its three operations in the input's dtype: equal to rounding).
"""

from typing import Tuple

import torch

Tensor = torch.Tensor


def applies(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether :func:`rotate` takes this call: queries and keys ``[b, h, s, d]`` of one dtype on a
    GPU with their last dimension dense, ``cos`` and ``sin`` ``[b or 1, s, d]`` of that dtype."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    b, _, s, d = q.shape
    return (q.is_cuda and k.shape[0] == b and k.shape[2] == s and k.shape[3] == d and d % 2 == 0
            and cos.shape[0] in (1, b) and cos.shape[1:] == (s, d) and q.stride(-1) == 1 and k.stride(-1) == 1
            and q.dtype == k.dtype == cos.dtype == sin.dtype)


def rotate(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    """``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)``, ``cos`` and ``sin``
    broadcast over the heads (``unsqueeze_dim=1``), each output laid out as its input."""
    from ._rope_triton import rope

    b, hq, s, d = q.shape
    hk = k.shape[1]
    cos, sin = cos.expand(b, s, d), sin.expand(b, s, d)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    half = d // 2
    rope[(b * s,)](q, k, cos, sin, qo, ko, s,
                   q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                   cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
                   qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
                   HQ=hq, HK=hk, HALF=half, HP=max(16, 1 << (half - 1).bit_length()),
                   BH=max(1, 1 << (max(hq, hk) - 1).bit_length()), num_warps=4)
    return qo, ko


def reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    """What :func:`rotate` computes, in torch at fp32 (for tests)."""
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)

    def one(x):
        x = x.float()
        x1, x2 = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return x * c + torch.cat((-x2, x1), dim=-1) * s
    return one(q).to(q.dtype), one(k).to(k.dtype)
