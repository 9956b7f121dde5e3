"""Outputs the caller owns, for the price of one graph launch instead of a clone per output.

Each captured graph can have a ring of output *slots*. A slot is memory of its own for every
tensor output (from the ordinary allocator, outside the graph pool, so no replay of any graph
writes it) and what fills it: on a GPU, a further capture of the forward that writes its
outputs into the slot, so a call replays one graph whether it hands out views or owned
outputs. A call takes a slot that nobody holds any more, runs its fill in place of the main
graph, and hands out the slot's tensors.

The recycling rule: a slot is taken again only when nothing but the slot refers to it: the
tensors it handed out are referenced only by the slot (Python reference counts), and its
memory by no tensor but the slot's own (storage use counts: every view the caller made, views
of views included, adds one). And only on the stream it was last handed out on, so work the
caller queued on that stream before dropping the output is ordered before the slot is written
again (the same rule the caching allocator keeps for freed memory). When every slot is held,
the call clones, and a new slot is made off the call path (its copy graph is a capture).
"""

import logging
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..core.records import cut
from ..core.tree import CONST

logger = logging.getLogger("graphwrap")
# The number of strong references to a storage (torch._C, used by torch.compile's CUDA graphs).
# None where torch has none: then no Slot is made (available()).
_use_count: Callable[[int], int] = getattr(torch._C, "_storage_Use_Count", None)  # type: ignore[assignment]
_refcount = sys.getrefcount
MAX_SLOTS = 4
# Outputs larger than this (all of one graph's, in bytes) are cloned: the copy then costs far
# more device time than its launch costs host time, and the ring would hold MAX_SLOTS copies.
MAX_SLOT_BYTES = 16 << 20
# A fill that could not be made (its capture failed) is tried again later, this many times in all.
MAX_FAILURES = 3


def storage_ref(t: torch.Tensor) -> int:
    """The address of ``t``'s storage, for :func:`use_count`."""
    return t.untyped_storage()._cdata


def available() -> bool:
    """Whether references can be counted: a storage's, and a Python object's exactly (not on a
    free-threaded Python, whose reference counts are deferred)."""
    gil = getattr(sys, "_is_gil_enabled", None)
    return _use_count is not None and (gil is None or gil())


def _refcounts(ts) -> List[int]:
    """Python reference counts of ``ts``'s items, counted as :meth:`Slot.free` counts them."""
    out = []
    for t in ts:
        out.append(_refcount(t))
    return out


class Slot:
    """One set of owned output buffers, what fills them, and the tensors last handed out.

    The tensors handed out for ``(n, L)`` are made once and handed out again whenever the slot
    is free: a fresh view per call would cost as much host time as the clone it replaces.
    """

    __slots__ = ("bases", "refs", "fill", "sid", "kinds", "seq_dims", "batch_dim", "static", "handed",
                 "use_counts", "ref_counts", "last", "last_refs")

    def __init__(self, bases: List[torch.Tensor], fill: Callable[[], None], kinds, seq_dims, batch_dim, static):
        self.bases = bases
        self.refs = [storage_ref(b) for b in bases]
        self.fill = fill
        self.sid = None  # the stream it was last handed out on (None: never handed out)
        self.kinds, self.seq_dims = kinds, seq_dims
        self.batch_dim = batch_dim
        self.static = static  # the static outputs: constants are handed out as they are
        self.handed: Dict[tuple, List[Any]] = {}  # (n, L) -> the outputs handed out (tensors made once)
        self.ref_counts: Dict[tuple, List[int]] = {}  # (n, L) -> their reference counts while only the slot holds them
        self.last: Optional[List[Any]] = None  # the outputs handed out last, and their reference counts when free
        self.last_refs: List[int] = []
        self._count_uses()

    def _count_uses(self):
        # The references the slot itself holds: its tensors and the views it keeps, and on some
        # torch versions the Python storage object that asking for the address made and keeps.
        self.use_counts = [_use_count(r) for r in self.refs]

    def free(self) -> bool:
        last = self.last
        if last is not None:
            refs, i = self.last_refs, 0
            for t in last:  # the same loop as _refcounts: the same references of its own
                if _refcount(t) != refs[i]:
                    return False
                i += 1
        for ref, count in zip(self.refs, self.use_counts):
            if _use_count(ref) != count:
                return False
        return True

    def views(self, n: int, L: Optional[int] = None) -> List[Any]:
        """The outputs cut to ``n`` rows and length ``L``; call on a free slot."""
        key = (n, L)
        out = self.handed.get(key)
        if out is None:
            out = []
            bases = iter(self.bases)
            for kind, sdims, o in zip(self.kinds, self.seq_dims, self.static):
                out.append(o if kind == CONST else cut(next(bases), kind, sdims, self.batch_dim, n, L))
            self.handed[key] = out
            # Views made of a tensor count as references to it (PyTorch keeps the base's Python
            # object alive from C++): every list's resting counts change with a new one. The slot
            # is free here (nothing of it is the caller's), so they are all taken again.
            for k, handed in self.handed.items():
                self.ref_counts[k] = _refcounts(handed)
            self._count_uses()
        self.last = out
        self.last_refs = self.ref_counts[key]
        # A list of the caller's own: its references to the tensors keep the slot held from here
        # on, also between the lock's release and the caller taking the tensors out of it.
        return list(out)


class OutputRing:
    """The slots of one captured graph. ``make_fill(bases, warm)`` returns a callable that writes
    the graph's outputs (for the inputs in its static inputs) into ``bases`` on the current stream."""

    __slots__ = ("static", "kinds", "seq_dims", "batch_dim", "make_fill", "slots", "max_slots", "failures",
                 "wanted", "growing", "error", "turn")

    def __init__(self, static: Sequence[Any], kinds: Sequence[str], batch_dim: int,
                 make_fill: Callable[[List[torch.Tensor], bool], Callable[[], None]],
                 max_slots: int = MAX_SLOTS, seq_dims=None):
        self.static = list(static)
        self.kinds = list(kinds)
        self.seq_dims = list(seq_dims) if seq_dims is not None else [()] * len(self.kinds)
        self.batch_dim = batch_dim
        self.make_fill = make_fill
        self.slots: List[Slot] = []
        self.max_slots = max_slots
        self.failures = 0  # fills that could not be made; at MAX_FAILURES the ring makes no more
        self.wanted = False  # a call found every slot held: another slot is due
        self.growing = False  # someone makes it
        self.error: Optional[BaseException] = None  # why the last slot could not be made
        self.turn = 0  # the slot to look at first: the one handed out longest ago

    def take(self, sid) -> Optional[Slot]:
        """A slot free to be filled on stream ``sid`` (one never handed out, or last handed out
        on ``sid``); None when none is (the caller clones).

        Slots are handed out in turn, so the first of ``sid``'s slots from the turn on is the
        one handed out longest ago: if the caller still holds that one, it holds the later ones
        too (a caller that keeps every output), and the look ends there, after one check rather
        than one per slot. A slot freed out of turn is found once the turn comes round to it."""
        slots = self.slots
        n = len(slots)
        start = self.turn
        held = False  # one of sid's handed-out slots is still held: only new ones are looked at
        for k in range(n):
            s = slots[(start + k) % n]
            if (s.sid is None or s.sid == sid) and (s.last is None or not held):
                if s.free():
                    s.sid = sid
                    self.turn = (start + k + 1) % n
                    return s
                held = held or s.last is not None
        return None

    def can_grow(self) -> bool:
        return len(self.slots) < self.max_slots and self.failures < MAX_FAILURES

    def want(self):
        """A call found every slot held: another slot is due (made by whoever claims it)."""
        if not self.wanted and self.can_grow():
            self.wanted = True

    def claim(self) -> bool:
        """Whether the caller is the one to make the slot that is due (one at a time)."""
        if self.wanted and not self.growing:
            self.growing = True
            return True
        return False

    def make(self, warm: bool = True) -> Optional[Slot]:
        """A new slot, not yet in the ring (its fill may be a capture: call it off the call
        path); None if it could not be made. ``warm``: run the forward once first (a thread
        that has not run it yet)."""
        srcs = [o for o, k in zip(self.static, self.kinds) if k != CONST]
        with torch.inference_mode(False):  # written by every later fill, in any mode
            bases = [torch.empty_like(o) for o in srcs]
        try:
            fill = self.make_fill(bases, warm)
        except Exception as e:  # noqa: BLE001 - no slot is no error: calls clone
            self.failures += 1
            self.error = e
            if self.failures == 1:
                logger.warning("an owned-output slot could not be made (%s: %s); outputs are cloned "
                               "while none is free", type(e).__name__, str(e).strip().splitlines()[0] if str(e) else "")
            return None
        return Slot(bases, fill, self.kinds, self.seq_dims, self.batch_dim, self.static)

    def add(self, slot: Slot):
        if len(self.slots) < self.max_slots:
            self.slots.append(slot)


def ring_for(static: Sequence[Any], kinds: Sequence[str], batch_dim: int, make_fill,
             seq_dims=None) -> Optional[OutputRing]:
    """A ring for a graph's outputs, or None where outputs are better cloned (none are tensors,
    they are large, or this torch cannot count a storage's references)."""
    if not available():
        return None
    tensors = [o for o, k in zip(static, kinds) if k != CONST]
    if not tensors:
        return None
    if sum(t.numel() * t.element_size() for t in tensors) > MAX_SLOT_BYTES:
        return None
    return OutputRing(static, kinds, batch_dim, make_fill, seq_dims=seq_dims)


def owned(graph, slot: Optional[Slot], outputs: List[Any], n: int, L: Optional[int]) -> List[Any]:
    """The outputs of one run of ``graph``, owned by the caller: the forward run into ``slot`` (a
    free slot of its ring, from ``ring.take``), or with None a replay and clones of ``outputs``
    (``graph.outputs_for(n, L)``); the ring then wants another slot, made by the caller once it
    let go of the engine's lock."""
    if slot is not None:
        slot.fill()  # the forward, writing straight into the slot
        return slot.views(n, L)
    graph.replay()
    if graph.ring is not None:
        graph.ring.want()
    return [o.clone() if t else o for o, t in zip(outputs, graph.is_tensor)]
