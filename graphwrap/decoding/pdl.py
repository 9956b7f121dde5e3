"""Programmatic dependent launch for graphwrap's Triton kernels (Hopper and later).

A CUDA graph runs a step's kernels one after another: a kernel's programs are placed on the SMs
only once every program of the kernel before it has ended, and the SMs idle in between (on the
1.1B Llama shape's 64-row step, some 264 kernels a replay, about 0.4 us each: 0.11 ms of 1.67 on
an H100; ``benchmarks/diagnostics/step_profile.py``). Launched with programmatic dependent launch
(compute capability 9 on, with a Triton that has it), a kernel's programs may be placed as the
kernel before it ends, and each waits at its first instruction (``gdc_wait``) until that kernel
has ended and its writes can be seen. Nothing a kernel reads or writes moves: only its launch
overlaps the last kernel's tail. Each of graphwrap's kernels takes a ``PDL`` constant: with it,
the wait is its first instruction, and :func:`launch` gives the launch's keywords.
"""

import functools
from typing import Optional

import torch

ON: Optional[bool] = None  # None: where the card and Triton have it; True or False: forced (tests, the profile)


@functools.lru_cache(maxsize=None)
def available(device: torch.device) -> bool:
    """Whether ``device`` (compute capability 9 on) and this Triton launch so."""
    try:
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and torch.cuda.get_device_capability(device)[0] >= 9


def launch(device: torch.device) -> dict:
    """The keywords of a launch on ``device`` of a kernel that takes ``PDL``."""
    if available(device) if ON is None else ON:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
