"""A decode step's new keys and values written into the paged pool in one kernel a layer (Triton).

Each row's key and value go to its slot (block, offset) of the pools. Indexed assignment
(``pool[where, offset] = key``) is one of PyTorch's index kernels for the keys and another for
the values, each a few microseconds for a few kilobytes: on the 1.1B Llama shape's 64-row step
(an H200) 0.17 ms of its 2.05 ms of kernels (``benchmarks/diagnostics/step_profile.py --ops``).
Here one program a row copies both. Used inside the shared batch where the step's paged kernel
runs and torch.compile is not tracing; elsewhere the assignment as before.
"""

import torch

from . import paged_attention

Tensor = torch.Tensor


def applies(keys: Tensor, values: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether :func:`write` takes these: pools ``[blocks, block, heads, d]`` alike and dense,
    the new key and value ``[n, heads, d]`` of the pools' dtype with their last dimension dense,
    on a GPU where the kernel runs."""
    return (k.is_cuda and not torch.compiler.is_compiling() and paged_attention.available()
            and keys.shape == values.shape and keys.stride() == values.stride() and keys.is_contiguous()
            and k.shape == v.shape and k.dim() == 3 and k.shape[1:] == keys.shape[2:]
            and k.dtype == v.dtype == keys.dtype == values.dtype and k.stride(-1) == 1 and v.stride(-1) == 1)


def write(keys: Tensor, values: Tensor, where: Tensor, offset: Tensor, k: Tensor, v: Tensor) -> None:
    """``keys[where, offset] = k`` and ``values[where, offset] = v`` (``k``, ``v``: ``[n, heads,
    d]``; ``where``, ``offset``: ``[n]``), in one kernel."""
    from ._step_write_triton import write_slots

    n, h, d = k.shape
    write_slots[(n,)](k, v, keys, values, where, offset, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                      keys.stride(0), keys.stride(1), keys.stride(2), H=h, D=d,
                      BH=max(1, 1 << (h - 1).bit_length()), DP=max(16, 1 << (d - 1).bit_length()), num_warps=1)


def reference(keys: Tensor, values: Tensor, where: Tensor, offset: Tensor, k: Tensor, v: Tensor) -> None:
    """What :func:`write` does, by indexed assignment."""
    keys[where, offset] = k
    values[where, offset] = v
