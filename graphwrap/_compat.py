"""Version gates and feature detection for the torch versions graphwrap supports (2.1 and newer)."""

import contextlib
import functools
import inspect

import torch
from packaging.version import Version

TORCH_VERSION = Version(torch.__version__.split("+")[0])

# Random numbers drawn while another thread captures: before torch 2.13, PyTorch puts the
# default CUDA generator into capture mode for each capture, and a draw from another thread
# then fails; from 2.13 each capture keeps its own generator state.
PER_CAPTURE_RNG = TORCH_VERSION >= Version("2.13")

# torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype arrived in 2.4.
_AUTOCAST_BY_DEVICE = hasattr(torch, "get_autocast_dtype")


def cuda_available() -> bool:
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of the CUDA ``device`` (the kernels' shapes of work follow them)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def autocast_state(device_type: str = "cuda"):
    """The autocast dtype in force for ``device_type``, or None when autocast is off.

    It is part of every graph key: a graph captured under autocast holds the casts.
    """
    if _AUTOCAST_BY_DEVICE:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return None
    if device_type == "cuda":
        if torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        return None
    if torch.is_autocast_cpu_enabled():
        return torch.get_autocast_cpu_dtype()
    return None


def autocast_without_cache(dtype):
    """Autocast for warm-up and capture with its weight-cast cache off.

    A cached cast made before capture would be replayed from memory that is freed when the
    caller's autocast region ends; with the cache off, every cast is recorded in the graph.
    """
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda", dtype=dtype, cache_enabled=False)


def _capture_begin_takes_mode() -> bool:
    if not hasattr(torch.cuda, "CUDAGraph"):
        return False
    try:
        return "capture_error_mode" in inspect.signature(torch.cuda.CUDAGraph.capture_begin).parameters
    except (TypeError, ValueError):
        return False


_CAPTURE_MODE = _capture_begin_takes_mode()


def capture_begin(graph, pool):
    # "thread_local": other threads may keep running CUDA work (their own models, other
    # GraphedModules) while this thread captures; "global" would fail their calls.
    if _CAPTURE_MODE:
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    else:
        graph.capture_begin(pool=pool)


_END_ALLOCATE = (getattr(torch._C, "_cuda_endAllocateToPool", None)  # torch >= 2.5
                 or getattr(torch._C, "_cuda_endAllocateCurrentStreamToPool", None))


def end_allocate_to_pool(device: torch.device, pool) -> None:
    """Stop routing allocations into ``pool`` after a capture whose end failed.

    When ending a capture fails, PyTorch raises before it tells the allocator that the capture
    is over: the capture stream's allocations (warm-ups included) would go on landing in that
    pool, and a new capture into it is refused as "already recording". Harmless, and silent,
    when the allocator had already let go of the pool.
    """
    if _END_ALLOCATE is None:
        return
    try:
        _END_ALLOCATE(device.index if device.index is not None else torch.cuda.current_device(), pool)
    except RuntimeError:
        pass


def registration_hooks():
    """Global hooks that fire when any module gets a new parameter, buffer or submodule."""
    import torch.nn.modules.module as m

    names = (
        "register_module_parameter_registration_hook",
        "register_module_buffer_registration_hook",
        "register_module_module_registration_hook",
    )
    return [getattr(m, n) for n in names if hasattr(m, n)]
