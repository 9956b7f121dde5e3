"""The device under the engine: where graphs can run, how they are captured and how time is taken.

:class:`CudaBackend` is the one graphwrap serves with. The CPU tests give the engine a stand-in
whose "graphs" recompute on replay, so every decision of the engine (keys, buckets, padding,
plans, joins, failures) runs on a CPU as it runs on a GPU.
"""

import logging
from typing import Callable, List, Optional, Union

import torch

from .. import _compat
from ..core.reasons import NO_CUDA, NOT_ON_CUDA, Eager
from ..core.tree import CONST, flatten_outputs
from .checks import CaptureFailed
from .cuda import (
    Pool,
    capture_session,
    device_sync,
    first_line,
    is_invalidated,
    record,
    timed_calls,
)
from .graph import CudaRecorder

logger = logging.getLogger("graphwrap")


class CudaBackend:
    """CUDA graphs on the module's GPU."""

    kind = "cuda"
    recorder = CudaRecorder()

    @staticmethod
    def device_for(module_device: Optional[torch.device], leaves) -> Union[torch.device, Eager]:
        """The device a call's graphs run on, or why it runs eagerly."""
        if not _compat.cuda_available():
            return NO_CUDA
        if module_device is None:
            # A module with no tensors of its own runs where its inputs are, call by call.
            t = next((x for x in leaves if x.is_cuda), None)
            return NOT_ON_CUDA if t is None else t.device
        if module_device.type != "cuda":
            return NOT_ON_CUDA
        return module_device

    @staticmethod
    def new_pool(device) -> Pool:
        return Pool(device)

    @staticmethod
    def slot_maker(device, pool: Pool, run, draws: bool, kinds) -> Callable:
        """``make_fill(bases)`` for a captured graph's output ring: a further capture of its
        forward (``run``) that also copies the outputs into ``bases``, so a call that hands out
        owned outputs replays one graph, as one that hands out views does. It holds no record
        of the graph's own (the ring is one of its fields: that would be a cycle)."""
        def make_fill(bases: List[torch.Tensor], warm: bool = True):
            return slot_graph(device, pool, run, draws, kinds, bases, warm)
        return make_fill

    @staticmethod
    def sync(device=None):
        device_sync(device)

    @staticmethod
    def timed(fn, k: int) -> float:
        return timed_calls(fn, k)

    @staticmethod
    def empty_cache():
        torch.cuda.empty_cache()


def slot_graph(device: torch.device, pool: Pool, run, draws: bool, kinds, bases, warm: bool = True):
    """A capture of a forward (``run``: on its graph's static inputs) that writes its tensor
    outputs into ``bases``; its replay. Raises CaptureFailed when the capture fails (the
    allocator and the generator are left as they were before it)."""
    g = torch.cuda.CUDAGraph()

    def body():
        outs = flatten_outputs(run())[0]
        for d, o in zip(bases, (o for o, k in zip(outs, kinds) if k != CONST)):
            d.copy_(o)

    try:
        with capture_session(device):
            # Once outside the capture (``warm``): this thread's cuBLAS handle is made here (a
            # thread other than the one that captured may not have run a matrix product yet), not
            # in it. The capture runs on the pool's stream (see cuda.Pool).
            if warm:
                run()
            record(g, pool, device, draws, body)
    except Exception as e:
        raise CaptureFailed(f"the owned-output graph could not be captured: {type(e).__name__}: {first_line(e)}",
                            e, pool_lost=is_invalidated(e)) from e
    return g.replay
