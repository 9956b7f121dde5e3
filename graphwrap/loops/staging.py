"""Buffers for host inputs on their way to the device, two sets taken in turns.

The direct call stages large host batches in device buffers, the Batcher joins host requests in
pinned buffers, the pipeline stages pageable batches in pinned buffers per graph. Each takes a
set, fills it, and marks it done with an event on the stream whose work reads it last; the set
is filled again two turns later, once that event has passed. So the host runs at most two
calls ahead of the device, and memory stays flat however far ahead it could issue.
"""

from typing import Dict, List, Optional, Sequence

import torch


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
