"""Which graph shape serves a forward of the shared batch, and how (plain Python).

Shapes are ``(kind, rows, positions)``. Where shapes are captured on a thread of their own
(:mod:`.captures`, a paged cache on a GPU), a forward is served by its shape's graph once it
is captured, else by the smallest captured graph of its kind that holds it (more padding rows
and masked positions, the same tokens), else eagerly, and the decode thread never waits for a
capture. A shape's own capture is asked for at once where nothing holds it (an eager forward
costs many replays), and once it has been wanted ``CAPTURE_AFTER`` times where a larger graph
holds it (so that a shape that passes by takes no capture's time from the rows). Elsewhere
(the rows layout) the capture runs in the decode thread, by the same rule.
"""

import collections
import threading
from typing import Callable, Counter, Dict, List, Optional, Set, Tuple

CAPTURE_AFTER = 16  # steps a shape is wanted, served by a larger captured one, before it is captured (inline)

INLINE = "inline"  # the engine's call: it captures a new shape there and then
GRAPH = "graph"  # a graph captured beside the decode thread (over a twin of the cache)
EAGER = "eager"  # the forward itself: no graph holds the shape yet (or its capture failed)
NEEDED, COVERED = 0, 2  # a capture's queue (see captures.py): nothing holds the shape meanwhile, or a larger graph


class Shapes:
    """Which shape serves a forward, and how (:data:`INLINE`, :data:`GRAPH` or :data:`EAGER`).

    ``want(shape, queue)``, where given, asks for a shape's capture beside the decode thread
    (once per shape; ``queue`` is ``NEEDED`` where nothing holds the shape meanwhile, else
    ``COVERED``, see :mod:`.captures`); the capturing thread reports each shape through
    :meth:`captured`."""

    def __init__(self, graphs: bool = True, want: Optional[Callable[[tuple, int], None]] = None):
        self.graphs, self.want = graphs, want
        self.ready: Set[tuple] = set()
        self.wanted: Counter[tuple] = collections.Counter()
        self.covered: Counter[str] = collections.Counter()
        self.eager: Counter[str] = collections.Counter()  # forwards run eagerly while no graph held them, by kind
        self.asked: Set[tuple] = set()
        self.failed: Dict[tuple, str] = {}
        self.reports: List[Tuple[tuple, Optional[str]]] = []  # (shape, None or why it failed), from the capturing thread
        # Guards reports, and the changes of ready, failed and the counts (the decode thread alone
        # makes them; stats() reads them from other threads).
        self.lock = threading.Lock()

    def captured(self, shape: tuple, why: Optional[str] = None):
        """From the capturing thread: ``shape`` serves by graph now (``why`` None), or never."""
        with self.lock:
            self.reports.append((shape, why))

    def counts(self) -> dict:
        """What ``stats()`` says of the shapes (from any thread): those a graph serves (reported
        ones included), forwards in a larger graph and eager ones by kind, failed captures."""
        with self.lock:
            return {"in_a_larger_graph": dict(self.covered), "shapes": sorted(set(self.ready) | {
                        s for s, why in self.reports if why is None}),
                    "eager_forwards": dict(self.eager), "capture_failed": {**self.failed, **{
                        s: why for s, why in self.reports if why is not None}}}

    def _count(self, counter: Counter[str], kind: str):
        with self.lock:
            counter[kind] += 1

    def _take_reports(self):
        with self.lock:
            for got, why in self.reports:
                if why is None:
                    self.ready.add(got)
                else:
                    self.failed[got] = why
            self.reports = []

    def pick(self, shape: tuple, counted: bool = True) -> Tuple[tuple, str]:
        """``(shape that serves, how)``; ``counted``: a forward run eagerly is counted as one (not
        where the caller runs something else instead: a mixed forward's two parts apart)."""
        if not self.graphs:
            return shape, INLINE
        if self.want is None:
            return self._inline(shape), INLINE
        if self.reports:
            self._take_reports()
        if shape in self.ready:
            return shape, GRAPH
        cover = self._cover(shape)
        if shape not in self.asked:
            self.wanted[shape] += 1
            if cover is None or self.wanted[shape] >= CAPTURE_AFTER:
                self.asked.add(shape)
                del self.wanted[shape]
                self.want(shape, NEEDED if cover is None else COVERED)
        if cover is not None:
            self._count(self.covered, shape[0])
            return cover, GRAPH
        if counted:
            self._count(self.eager, shape[0])
        return shape, EAGER

    def _cover(self, shape: tuple) -> Optional[tuple]:
        cover = [s for s in self.ready if s[0] == shape[0] and s[1] >= shape[1] and s[2] >= shape[2]]
        return min(cover, key=lambda s: s[1] * s[2]) if cover else None

    def _inline(self, shape: tuple) -> tuple:
        if shape in self.ready:
            return shape
        self.wanted[shape] += 1
        cover = self._cover(shape)
        if cover is not None and self.wanted[shape] < CAPTURE_AFTER:
            self._count(self.covered, shape[0])
            return cover
        with self.lock:
            self.ready.add(shape)
        del self.wanted[shape]
        return shape
