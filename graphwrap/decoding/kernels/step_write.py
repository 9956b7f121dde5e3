"""A decode step's new keys and values written into the paged pool in one kernel a layer (Triton).

Each row's key and value go to its slot (block, offset) of the pools. Indexed assignment
(``pool[where, offset] = key``) is one of PyTorch's index kernels for the keys and another for
the values, each a few microseconds for a few kilobytes: on the 1.1B Llama shape's 64-row step
(an H200) 0.17 ms of its 2.05 ms of kernels (``benchmarks/diagnostics/step_profile.py --ops``).
Here one program a row copies both. Used inside the shared batch where the step's paged kernel
runs; elsewhere the assignment as before.

While torch.compile traces, every write into the paged pool (:func:`put`: a step's, a prompt's, a
piece's) is torch's operator ``graphwrap::put_slots``, which says it writes into both pools.
Traced as an indexed assignment instead, the write into a pool that the attention also reads
through a view of its own (the paged kernel's) made Inductor copy the whole layer's pool to a
buffer and back on every forward: two kernels of some 50 us a layer on GPT-2's 64-row step (an
H200), which made ``compile=True``'s warm bursts 2.2x slower than the default's
(``benchmarks/diagnostics/step_profile.py --compile``). The operator is written in place.
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


def put(keys: Tensor, values: Tensor, where: Tensor, offset: Tensor, k: Tensor, v: Tensor) -> None:
    """``keys[where, offset] = k`` and ``values[where, offset] = v``, cast to the pools' dtype: one
    kernel where :func:`write` applies, else indexed assignment; while torch.compile traces,
    through :func:`put_slots` (see the module's note)."""
    if torch.compiler.is_compiling():
        put_slots(keys, values, where, offset, k, v)
    elif applies(keys, values, k, v):
        write(keys, values, where, offset, k, v)
    else:
        reference(keys, values, where, offset, k.to(keys.dtype), v.to(values.dtype))


@torch.library.custom_op("graphwrap::put_slots", mutates_args=("keys", "values"))
def put_slots(keys: Tensor, values: Tensor, where: Tensor, offset: Tensor, k: Tensor, v: Tensor) -> None:
    """:func:`put` as torch's operator (run as it is inside compiled code)."""
    put(keys, values, where, offset, k, v)


@put_slots.register_fake
def _(keys, values, where, offset, k, v):
    return None
