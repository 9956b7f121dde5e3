"""Outputs the caller owns, for the price of one graph launch instead of a clone per output.

Each captured graph can have a ring of output *slots*. A slot is memory of its own for every
tensor output (from the ordinary allocator, outside the graph pool, so no replay of any graph
writes it) and a small captured graph that copies the graph's static outputs into it. A call
takes a slot that nobody holds any more, replays its copy graph right after the main graph,
and hands out fresh views of the slot's memory.

The recycling rule: a slot is taken again only when nothing but the slot refers to it: the
tensors it handed out are referenced only by the slot (Python reference counts), and its
memory by no tensor but the slot's own (storage use counts: every view the caller made, views
of views included, adds one). And only on the stream it was last handed out on, so work the caller
queued on that stream before dropping the output is ordered before the slot is written again
(the same rule the caching allocator keeps for freed memory). When every slot is held, the
call falls back to a clone.
"""

import sys
from typing import Any, Callable, List, Optional, Sequence

import torch

from .tree import BATCHED, CONST

# The number of strong references to a storage (torch._C, used by torch.compile's CUDA graphs).
_use_count = getattr(torch._C, "_storage_Use_Count", None)
_refcount = sys.getrefcount
MAX_SLOTS = 4
# Outputs larger than this (all of one graph's, in bytes) are cloned: the copy then costs far
# more device time than its launch costs host time, and the ring would hold MAX_SLOTS copies.
MAX_SLOT_BYTES = 16 << 20
# A fill that could not be made (its capture failed) is tried again on later calls, this many
# times in all; the calls meanwhile clone.
MAX_FAILURES = 3


def storage_ref(t: torch.Tensor) -> int:
    """The address of ``t``'s storage, for :func:`use_count`."""
    return t.untyped_storage()._cdata


def use_count(ref: int) -> int:
    return _use_count(ref)


def available() -> bool:
    """Whether references can be counted: a storage's, and a Python object's exactly (not on a
    free-threaded Python, whose reference counts are deferred)."""
    gil = getattr(sys, "_is_gil_enabled", None)
    return _use_count is not None and (gil is None or gil())


class Slot:
    """One set of owned output buffers, the graph (or stand-in) that fills them, and the tensors
    last handed out of them.

    The tensors handed out for ``n`` rows are made once and handed out again whenever the
    slot is free: a fresh view per call would cost as much host time as the clone it replaces.
    Free means: the tensors last handed out have no references but the slot's own (their
    Python reference counts), and the memory has no tensors on it but the slot's own (the
    storages' use counts, which see every view the caller made of them).
    """

    __slots__ = ("bases", "refs", "fill", "sid", "kinds", "batch_dim", "static", "handed", "use_counts",
                 "ref_counts", "last", "last_refs")

    def __init__(self, bases: List[torch.Tensor], fill: Callable[[], None], sid, kinds, batch_dim, static):
        self.bases = bases
        self.refs = [storage_ref(b) for b in bases]
        self.fill = fill
        self.sid = sid
        self.kinds = kinds
        self.batch_dim = batch_dim
        self.static = static  # the static outputs: constants are handed out as they are
        self.handed = {}  # n -> the outputs handed out for n rows (tensors made once)
        self.ref_counts = {}  # n -> their Python reference counts while only the slot holds them
        self.last = None  # the outputs handed out last, and their reference counts when free
        self.last_refs = None
        self._count_uses()

    def _count_uses(self):
        # The references the slot itself holds: its tensors and the views it keeps, and on some
        # torch versions the Python storage object that asking for the address made and keeps.
        self.use_counts = [_use_count(r) for r in self.refs]

    def free(self) -> bool:
        last = self.last
        if last is not None:
            for t, rc in zip(last, self.last_refs):
                if _refcount(t) != rc:
                    return False
        for ref, count in zip(self.refs, self.use_counts):
            if _use_count(ref) != count:
                return False
        return True

    def views(self, n: int) -> List[Any]:
        """The outputs cut to ``n`` rows, in the order of the outputs; call on a free slot."""
        out = self.handed.get(n)
        if out is None:
            out = []
            bases = iter(self.bases)
            for kind, o in zip(self.kinds, self.static):
                if kind == CONST:
                    out.append(o)
                    continue
                b = next(bases)
                out.append(b.narrow(self.batch_dim, 0, n) if kind == BATCHED and b.shape[self.batch_dim] != n else b)
            self.handed[n] = out
            self.ref_counts[n] = [_refcount(t) for t in out]
            self._count_uses()
        self.last = out
        self.last_refs = self.ref_counts[n]
        return out


class OutputRing:
    """The slots of one captured graph. ``make_fill(dsts, srcs)`` returns a callable that copies
    ``srcs`` into ``dsts`` on the current stream (a captured graph's replay on a GPU)."""

    __slots__ = ("static", "kinds", "batch_dim", "make_fill", "slots", "max_slots", "failures")

    def __init__(self, static: Sequence[Any], kinds: Sequence[str], batch_dim: int,
                 make_fill: Callable[[List[torch.Tensor], List[torch.Tensor]], Callable[[], None]],
                 max_slots: int = MAX_SLOTS):
        self.static = list(static)
        self.kinds = list(kinds)
        self.batch_dim = batch_dim
        self.make_fill = make_fill
        self.slots: List[Slot] = []
        self.max_slots = max_slots
        self.failures = 0  # fills that could not be made; at MAX_FAILURES the ring hands out nothing

    def take(self, sid) -> Optional[Slot]:
        """A slot free to be filled on stream ``sid``, made if there are fewer than ``max_slots``;
        None when every slot is held (the caller clones)."""
        for s in self.slots:
            if s.sid == sid and s.free():
                return s
        if len(self.slots) >= self.max_slots or self.failures >= MAX_FAILURES:
            return None
        srcs = [o for o, k in zip(self.static, self.kinds) if k != CONST]
        bases = [torch.empty_like(o) for o in srcs]
        try:
            fill = self.make_fill(bases, srcs)
        except Exception:  # noqa: BLE001 - no slot is no error: this call's outputs are cloned
            self.failures += 1
            return None
        s = Slot(bases, fill, sid, self.kinds, self.batch_dim, self.static)
        self.slots.append(s)
        return s


def ring_for(static: Sequence[Any], kinds: Sequence[str], batch_dim: int, make_fill) -> Optional[OutputRing]:
    """A ring for a graph's outputs, or None where outputs are better cloned (none are tensors,
    they are large, or this torch cannot count a storage's references)."""
    if not available():
        return None
    tensors = [o for o, k in zip(static, kinds) if k != CONST]
    if not tensors:
        return None
    if sum(t.numel() * t.element_size() for t in tensors) > MAX_SLOT_BYTES:
        return None
    return OutputRing(static, kinds, batch_dim, make_fill)
