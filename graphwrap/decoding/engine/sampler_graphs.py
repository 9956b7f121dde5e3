"""The step's sampling as one CUDA graph of its own (on a GPU).

Eagerly, a step's sampler is about sixty small launches (a grammar's mask, penalties, top-k,
top-p, the Gumbel noise's hash, argmax), about 1 ms of the decode thread a step on an H200 host.
Where the thread must wait for a step's tokens before it samples the next (a row with a grammar:
its mask needs them), that millisecond no longer hides behind the device's work, and a batch
with a constrained row stepped 1.25x slower (``benchmarks/results/h200-2026-11-29-structured/``).
Replayed, it is one launch.

A graph freezes the addresses it read and the Python choices made while it was captured, so its
key (:func:`key`) holds every one: the step's row count, the logits' and lengths' addresses and
layout, which processors the live rows use (:class:`~.sampling.Active`, but the log-probabilities,
computed apart), and the addresses and widths of the tables a request can replace (end-of-sequence
ids, biases, the token history). The settings' values are read from the device tables at replay.
A key is captured the second time it is seen (the first runs eagerly: lazy set-up stays out of the
capture), on the decode thread, only where no other capture is under way (else eagerly this step,
and captured later). The graphs share one pool; a replay's tokens are read (copied to the next
step's inputs and to the host) before the next replay overwrites them.

A capture that fails leaves that key eager for good, said once in the log; one invalidated from
outside is tried again later, :data:`TRIES` times at most. At most :data:`MOST` graphs, each of
at most :data:`MOST_SCORES` scores; past either, steps sample eagerly.
"""

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Set

import torch

from ...capture.cuda import NotBegun, Pool, is_invalidated, record
from ...process import CAPTURE_LOCK

logger = logging.getLogger("graphwrap")
Tensor = torch.Tensor
MOST = 256  # sampler graphs per batch (each a few hundred kernel nodes; their memory is one shared pool)
# Scores a graphed step may hold (rows x vocabulary). The pool keeps its largest graph's working
# memory for good (sampled rows: a few int64 tensors of that size, by estimate 1 GB at 256 rows of a
# 128,256-token vocabulary, just under this bound), where eager sampling gives it back to the
# allocator between steps; past it, the step samples eagerly (a step that large is bound by the
# device, not by its launches).
MOST_SCORES = 1 << 25
CAPTURE_AT = 2  # the sighting of a key that captures it
TRIES = 8  # captures of a key invalidated from outside before it is left eager for good
ENABLED = True  # graphs for the sampler where the batch is on a GPU (False: eagerly, as before)


def key(settings, logits: Tensor, n: int, lengths: Tensor, active) -> tuple:
    """What a sampler graph of ``n`` rows froze: equal keys replay the same work on the same memory."""
    flags = dataclasses.replace(active, logprobs=-1)  # (computed outside the sampler)
    history = settings.history
    return (n, logits.data_ptr(), logits.dtype, tuple(logits.shape), logits.stride(),
            lengths.data_ptr(), lengths.dtype, tuple(lengths.shape), dataclasses.astuple(flags),
            settings.eos.data_ptr(), settings.eos.shape[1],
            settings.bias_ids.data_ptr(), settings.bias_values.data_ptr(), settings.bias_ids.shape[1],
            0 if history is None else history.data_ptr(), settings.masks is not None)


@dataclass
class Entry:
    """A captured sampler: replay it, and ``tokens`` holds the step's tokens (until the next replay)."""

    graph: Any  # a torch.cuda.CUDAGraph (tests: a stand-in with replay())
    tokens: Tensor


class SamplerGraphs:
    """The sampler graphs of one batch, by :func:`key`: count, capture, replay."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.entries: Dict[tuple, Entry] = {}
        self.seen: Dict[tuple, int] = {}
        self.eager: Set[tuple] = set()  # keys whose capture failed: eagerly for good
        self.tries: Dict[tuple, int] = {}  # captures of a key that failed from outside (tried again)
        self.pool: Optional[Pool] = None  # made at the first capture
        self.counts = {"replays": 0, "captures": 0, "failed": 0, "eager": 0}

    def tokens(self, settings, logits: Tensor, n: int, lengths: Tensor, active,
               body: Callable[[], Tensor]) -> Optional[Tensor]:
        """The step's tokens by a replay of ``body``'s graph (captured now if its time has come);
        None where the step samples eagerly (the caller runs ``body`` itself)."""
        if n * logits.shape[-1] > MOST_SCORES:
            self.counts["eager"] += 1
            return None
        k = key(settings, logits, n, lengths, active)
        entry = self.entries.get(k)
        if entry is None:
            entry = self._maybe_capture(k, body)
            if entry is None:
                self.counts["eager"] += 1
                return None
        self._replay(entry)
        self.counts["replays"] += 1
        return entry.tokens

    def _maybe_capture(self, k: tuple, body: Callable[[], Tensor]) -> Optional[Entry]:
        if k in self.eager or len(self.entries) >= MOST:
            return None
        seen = self.seen[k] = self.seen.get(k, 0) + 1
        if seen < CAPTURE_AT:
            return None
        try:
            entry = self._capture(body)
        except Exception as e:  # noqa: BLE001 - the sampler runs eagerly, as before
            tries = self.tries[k] = self.tries.get(k, 0) + 1
            if try_later(e) and tries <= TRIES:
                return None
            self.eager.add(k)
            self.counts["failed"] += 1
            if self.counts["failed"] == 1:
                logger.warning("the sampler of a %d-row step could not be captured (%s: %s); it samples "
                               "eagerly", k[0], type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return None
        if entry is None:  # (another capture under way: try again at a later step)
            return None
        self.entries[k] = entry
        self.seen.pop(k, None)
        self.tries.pop(k, None)
        self.counts["captures"] += 1
        return entry

    def _capture(self, body: Callable[[], Tensor]) -> Optional[Entry]:
        """``body``'s launches as a graph in the shared pool, on the pool's stream; None where
        another thread is capturing (a capture waits for nobody on the decode thread)."""
        if not CAPTURE_LOCK.acquire(blocking=False):
            return None
        try:
            if self.pool is None:
                self.pool = Pool(self.device, fresh=True)
            graph = torch.cuda.CUDAGraph()
            out = record(graph, self.pool, self.device, False, body, matmuls=False)  # (sorts, scans, no product)
        finally:
            CAPTURE_LOCK.release()
        return Entry(graph, out)

    def reset(self) -> None:
        """Every graph and the pool given back (the batch has ended); a later step would sample
        eagerly and capture anew."""
        self.entries.clear()
        self.seen.clear()
        self.tries.clear()
        self.pool = None

    @staticmethod
    def _replay(entry: Entry) -> None:
        entry.graph.replay()


def try_later(e: BaseException) -> bool:
    """A failed capture to try again later: invalidated from outside, or never begun."""
    return isinstance(e, NotBegun) or is_invalidated(e)
