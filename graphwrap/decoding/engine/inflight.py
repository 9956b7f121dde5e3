"""Tokens a step has queued on the device and the host has not read yet.

Steps are queued ahead: a step's tokens are copied into a pinned buffer and an event recorded
behind them, and the host reads them (waiting on the event) only after later steps have been
queued, so the GPU never waits for the host's bookkeeping. Pinned buffers and events are kept
and used again once read (a fresh pinned tensor and event each step cost host time the step
does not have).
"""

import collections
import ctypes
import time
from dataclasses import dataclass
from typing import Callable, Deque, Iterator, List, Optional, Tuple

import torch


@dataclass(eq=False)
class InFlight:
    """One step's tokens: which sequence each row's token is for."""

    seqs: list  # the scheduler's Seq, one per entry of ``rows``
    rows: List[int]
    host: torch.Tensor
    event: Optional[torch.cuda.Event]
    buf: Optional[torch.Tensor] = None  # the pinned buffer ``host`` is a view of
    extra: Optional[torch.Tensor] = None  # rows' log-probabilities where some row asked (sampling.logprobs)
    extras: Optional[bytes] = None  # the same, read: float32 rows of 1 + 2 * most values
    most: int = 0


class Tokens:
    """The queue of steps' tokens on their way to the host."""

    def __init__(self, rows: int, device: torch.device):
        self.rows, self.device = rows, device
        self.queued: Deque[InFlight] = collections.deque()
        self.spare: List[tuple] = []  # (pinned buffer, event) pairs read and free again

    def queue(self, seqs: list, at: List[int], tokens: torch.Tensor, extra: Optional[torch.Tensor] = None):
        """The tokens of a step just queued (``tokens[at[i]]`` is ``seqs[i]``'s), and their
        log-probabilities where some row asked (``extra``, rows as ``tokens``)."""
        if self.device.type == "cuda":
            buf, event = self.spare.pop() if self.spare else (
                torch.empty(self.rows, dtype=torch.long, pin_memory=True), torch.cuda.Event())
            host = buf[:tokens.shape[0]]
            host.copy_(tokens, non_blocking=True)
            if extra is not None:  # (a fresh pinned buffer: only steps with a row that asked)
                extra = torch.empty(extra.shape, dtype=extra.dtype, pin_memory=True).copy_(extra, non_blocking=True)
            event.record()
        else:
            buf, host, event = None, tokens, None
        self.queued.append(InFlight(seqs, at, host, event, buf, extra))

    def read(self, keep: int, spent: dict,
             before_wait: Optional[Callable[[], None]] = None) -> Iterator[Tuple[InFlight, List[int], float]]:
        """Each step's tokens, oldest first, but the last ``keep`` steps' (unless already done);
        the seconds waited go to ``spent["read_wait"]``. ``before_wait`` runs before each wait
        for the device (the caller hands out what it read so far: a turn that reads two steps
        does not hold the first's tokens back while it waits for the second)."""
        while self.queued:
            f = self.queued[0]
            if len(self.queued) <= keep and (f.event is None or not f.event.query()):
                return
            if f.event is not None:
                if before_wait is not None and not f.event.query():
                    before_wait()
                t0 = time.perf_counter()
                f.event.synchronize()
                spent["read_wait"] += time.perf_counter() - t0
            self.queued.popleft()
            tokens = f.host.tolist()
            if f.extra is not None:  # (its bytes as they are: no Python number per value here)
                x = f.extra.contiguous()
                f.extras, f.most = ctypes.string_at(x.data_ptr(), x.numel() * x.element_size()), (x.shape[1] - 1) // 2
            if f.buf is not None:
                self.spare.append((f.buf, f.event))
            yield f, tokens, time.perf_counter()
