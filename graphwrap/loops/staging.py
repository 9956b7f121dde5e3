"""Buffers for host inputs on their way to the device, two sets taken in turns.

The direct call stages large host batches in device buffers, the Batcher joins host requests in
pinned buffers, the pipeline stages pageable batches in pinned buffers per graph. Each takes a
set, fills it, and marks it done with an event on the stream whose work reads it last; the set
is filled again two turns later, once that event has passed. So the host runs at most two
calls ahead of the device, and memory stays flat however far ahead it could issue.
"""

import functools
from typing import Any, Dict, List, Optional, Sequence

import torch

# Event.record(stream) and Stream.wait_event(event) as the C calls behind them, without their
# Python layers (a microsecond of host time each, which a call at batch 1 feels); the plain
# methods where torch has no CUDA.
_event_base = getattr(torch._C, "_CudaEventBase", None)
record_event = getattr(_event_base, "record", None) or torch.cuda.Event.record
wait_event = getattr(_event_base, "wait", None) or torch.cuda.Event.wait
# Likewise torch.cuda.set_stream (a context manager of torch.cuda.stream costs ten times more).
# It makes the stream's device current too: callers switch only on the current device.
_cuda_set_stream = getattr(torch._C, "_cuda_setStream", None)
current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def setter(stream):
    """A no-argument callable that makes ``stream`` current, as ``torch.cuda.set_stream`` does."""
    if _cuda_set_stream is None:
        return functools.partial(torch.cuda.set_stream, stream)
    return functools.partial(_cuda_set_stream, stream_id=stream.stream_id, device_index=stream.device_index,
                             device_type=stream.device_type)


# At most this many bytes of a host input go through HostCopy, more through DeviceCopy. Below
# it the copy on the caller's stream costs the device less than DeviceCopy's extra calls cost
# the host; above it the copy's device time is better hidden beside the replay before it.
HOST_COPY_BYTES = 16 << 10


class Stager:
    """Two sets of buffers (pinned host memory, or memory on ``device``), taken in turns."""

    __slots__ = ("device", "sets", "events", "turn")

    def __init__(self, device: Optional[torch.device] = None, turns: int = 2):
        self.device = device  # None: pinned host buffers
        self.sets: List[Dict[int, torch.Tensor]] = [{} for _ in range(turns)]
        self.events: List[Optional[torch.cuda.Event]] = [None] * turns
        self.turn = 0

    def take(self) -> int:
        """The next set's index."""
        turn = self.turn
        self.turn = (turn + 1) % len(self.sets)
        return turn

    def buffer(self, turn: int, i: int, shape: Sequence[int], dtype: torch.dtype, dim: int = 0):
        """Buffer ``i`` of set ``turn``, viewed as ``shape``: the one made before if it has the
        dtype and the other dims and is long enough along ``dim``; a new one otherwise. Returns
        ``(view, new)``: a new buffer comes from the caching allocator, so a device buffer must
        be ordered after the work that freed its memory."""
        b = self.sets[turn].get(i)
        shape = tuple(shape)
        if (b is not None and b.dtype == dtype and b.dim() == len(shape) and b.shape[dim] >= shape[dim]
                and b.shape[:dim] + b.shape[dim + 1:] == shape[:dim] + shape[dim + 1:]):
            return b.narrow(dim, 0, shape[dim]), False
        with torch.inference_mode(False):  # refilled by later calls, in any mode
            if self.device is None:
                b = torch.empty(shape, dtype=dtype, pin_memory=True)
            else:
                b = torch.empty(shape, dtype=dtype, device=self.device)
        self.sets[turn][i] = b
        return b, True

    def wait_host(self, turn: int):
        """Block until the work that last read set ``turn`` is over (before refilling pinned memory)."""
        ev = self.events[turn]
        if ev is not None:
            ev.synchronize()

    def wait_stream(self, turn: int, stream):
        """Make ``stream`` wait until the work that last read set ``turn`` is over."""
        ev = self.events[turn]
        if ev is not None:
            stream.wait_event(ev)

    def done(self, turn: int, stream):
        """Set ``turn`` is read by the work issued so far on ``stream``."""
        ev = self.events[turn]
        if ev is None:
            ev = self.events[turn] = torch.cuda.Event()
        ev.record(stream)


class HostCopy:
    """Two pinned buffers shaped as one small host input, taken in turns: ``copy(dst, x,
    engine)`` copies ``x`` into the next buffer on the host (the caller's memory is read when
    it returns) and from there into ``dst`` on the caller's stream, not waited for. A buffer
    is refilled once the device copy that read it (two calls ago) is over."""

    __slots__ = ("bufs", "events", "turn")

    def __init__(self):
        self.bufs: List[torch.Tensor] = []
        self.events: List[torch.cuda.Event] = []
        self.turn = 0

    def copy(self, dst: torch.Tensor, x: torch.Tensor, engine) -> None:
        """The caller holds the engine's lock and has ordered its stream (``engine.last_stream``)."""
        i = self.turn
        self.turn = i ^ 1
        if i < len(self.bufs):
            self.events[i].synchronize()
            b = self.bufs[i]
        else:
            with torch.inference_mode(False):  # refilled by later calls, in any mode
                b = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self.bufs.append(b)
            self.events.append(torch.cuda.Event())
        b.copy_(x)
        dst.copy_(b, non_blocking=True)
        record_event(self.events[i], engine.last_stream)


class DeviceCopy:
    """Two device buffers shaped as one graph's static input (every plan of the graph's bucket
    uses their first rows), taken in turns: ``copy(dst, x, engine)`` copies the host tensor
    ``x`` into the next buffer on the engine's copy stream, beside whatever the caller's stream
    still runs, waits on the host for that copy alone (the caller's memory is then read), and
    copies the buffer into ``dst`` on the caller's stream. A buffer is written again once the
    device copy that read it (two calls ago) is over."""

    __slots__ = ("static", "batch_dim", "bufs", "copied", "read", "turn", "views", "copy_stream", "to_copy",
                 "compute", "back")

    def __init__(self, static: torch.Tensor, batch_dim: Optional[int]):
        self.static, self.batch_dim = static, batch_dim
        self.bufs: List[torch.Tensor] = []
        self.copied: List[torch.cuda.Event] = []
        self.read: List[torch.cuda.Event] = []
        self.turn = 0
        self.views: Dict[tuple, torch.Tensor] = {}  # (turn, shape) -> the buffer's first rows
        # the engine's copy stream, the caller's last stream, and setters that make each current
        self.copy_stream: Any = None
        self.to_copy: Any = None
        self.compute: Any = None
        self.back: Any = None

    def copy(self, dst: torch.Tensor, x: torch.Tensor, engine) -> None:
        """The caller holds the engine's lock and has ordered its stream (``engine.last_stream``)."""
        index = self.static.device.index
        if current_device() != index:
            with torch.cuda.device(index):
                self._copy(dst, x, engine)
        else:
            self._copy(dst, x, engine)

    def _copy(self, dst, x, engine):
        compute = engine.last_stream
        i = self.turn
        self.turn = i ^ 1
        if i == len(self.bufs):
            self._add(engine, compute)
        else:
            wait_event(self.read[i], self.copy_stream)  # the copy into dst that read it is over
        buf = self.views.get((i, x.shape))
        if buf is None:
            buf = self.bufs[i]
            bd = self.batch_dim
            if bd is not None and x.shape[bd] != buf.shape[bd]:
                buf = buf.narrow(bd, 0, x.shape[bd])
            self.views[(i, x.shape)] = buf
        if compute is not self.compute:
            self.compute, self.back = compute, setter(compute)
        self.to_copy()
        try:
            buf.copy_(x, non_blocking=True)
            record_event(self.copied[i], self.copy_stream)
        finally:
            self.back()
        self.copied[i].synchronize()
        wait_event(self.copied[i], compute)
        dst.copy_(buf)
        record_event(self.read[i], compute)

    def _add(self, engine, compute):
        if self.copy_stream is None:
            self.copy_stream = engine.copy_stream(self.static.device)
            self.to_copy = setter(self.copy_stream)
        with torch.inference_mode(False):  # refilled by later calls, in any mode
            b = torch.empty_like(self.static)
        b.record_stream(self.copy_stream)  # written there: never handed on while a copy runs
        self.copy_stream.wait_stream(compute)  # new memory: what the caller's stream did with it comes first
        self.bufs.append(b)
        self.copied.append(torch.cuda.Event())
        self.read.append(torch.cuda.Event())
