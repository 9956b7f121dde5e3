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

import functools

import torch

from . import paged_attention

Tensor = torch.Tensor
FP8_LARGEST = 448.0  # E4M3's largest finite value: what a key over its scale is held within (cache/fp8.py)


def applies(keys: Tensor, values: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether :func:`write` takes these: pools ``[blocks, block, heads, d]`` alike and dense,
    the new key and value ``[n, heads, d]`` of the pools' dtype (or any, into FP8 pools on a GPU
    whose kernels write E4M3) with their last dimension dense, on a GPU where the kernel runs."""
    fp8_pools = keys.dtype == values.dtype == torch.float8_e4m3fn
    return (k.is_cuda and not torch.compiler.is_compiling() and paged_attention.available()
            and keys.shape == values.shape and keys.stride() == values.stride() and keys.is_contiguous()
            and k.shape == v.shape and k.dim() == 3 and k.shape[1:] == keys.shape[2:] and k.dtype == v.dtype
            and ((fp8_pools and writes_e4m3(k.device)) or k.dtype == keys.dtype == values.dtype)
            and k.stride(-1) == 1 and v.stride(-1) == 1)


@functools.lru_cache(maxsize=None)
def writes_e4m3(device: torch.device) -> bool:
    """Whether Triton's kernels convert to and from E4M3 on ``device``: a GPU of compute
    capability 8.9 or later (elsewhere an FP8 pool is written and read in torch)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def write(keys: Tensor, values: Tensor, where: Tensor, offset: Tensor, k: Tensor, v: Tensor,
          k_scale: float = 0.0, v_scale: float = 0.0) -> None:
    """``keys[where, offset] = k`` and ``values[where, offset] = v`` (``k``, ``v``: ``[n, heads,
    d]``; ``where``, ``offset``: ``[n]``), in one kernel; with scales (FP8 pools), each over its
    scale, saturated and rounded as :func:`..cache.fp8.encode` does."""
    from ._step_write_triton import write_slots

    n, h, d = k.shape
    scaled = k_scale > 0
    write_slots[(n,)](k, v, keys, values, where, offset, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                      keys.stride(0), keys.stride(1), keys.stride(2), 1.0 / k_scale if scaled else 1.0,
                      1.0 / v_scale if scaled else 1.0, H=h, D=d,
                      BH=max(1, 1 << (h - 1).bit_length()), DP=max(16, 1 << (d - 1).bit_length()), SCALED=scaled,
                      LARGEST=FP8_LARGEST, num_warps=1)


def reference(keys: Tensor, values: Tensor, where: Tensor, offset: Tensor, k: Tensor, v: Tensor,
              k_scale: float = 0.0, v_scale: float = 0.0) -> None:
    """What :func:`write` does, by indexed assignment."""
    if k_scale > 0:
        k, v = scaled(k, k_scale), scaled(v, v_scale)
    keys[where, offset] = k.to(keys.dtype)
    values[where, offset] = v.to(values.dtype)


def scaled(x: Tensor, scale: float) -> Tensor:
    """``x`` times one over ``scale`` in fp32, held within +-:data:`FP8_LARGEST`: what an FP8
    pool's write rounds (as the kernel computes it)."""
    return (x.float() * (1.0 / scale)).clamp_(-FP8_LARGEST, FP8_LARGEST)


def put(keys: Tensor, values: Tensor, where: Tensor, offset: Tensor, k: Tensor, v: Tensor,
        scales=None) -> None:
    """``keys[where, offset] = k`` and ``values[where, offset] = v``, cast to the pools' dtype
    (``scales``: the layer's :class:`~..cache.fp8.Scales` where the pools are FP8): one kernel
    where :func:`write` applies, else indexed assignment; while torch.compile traces, through
    :func:`put_slots` (see the module's note)."""
    ks, vs = (float(scales.keys), float(scales.values)) if scales is not None else (0.0, 0.0)
    if torch.compiler.is_compiling():
        put_slots(keys, values, where, offset, k, v, ks, vs)
    elif applies(keys, values, k, v):
        write(keys, values, where, offset, k, v, ks, vs)
    else:
        reference(keys, values, where, offset, k, v, ks, vs)


@torch.library.custom_op("graphwrap::put_slots", mutates_args=("keys", "values"))
def put_slots(keys: Tensor, values: Tensor, where: Tensor, offset: Tensor, k: Tensor, v: Tensor,
              k_scale: float = 0.0, v_scale: float = 0.0) -> None:
    """:func:`put` as torch's operator (run as it is inside compiled code)."""
    if applies(keys, values, k, v):
        write(keys, values, where, offset, k, v, k_scale, v_scale)
    else:
        reference(keys, values, where, offset, k, v, k_scale, v_scale)


@put_slots.register_fake
def _(keys, values, where, offset, k, v, k_scale=0.0, v_scale=0.0):
    return None
