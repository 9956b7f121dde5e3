"""The engine's side of a capture: the :class:`Capturer`, one per engine, which owns the capture
state (the worker, what it is doing, the compile and tuning state) and hands the work to
:mod:`.work` (capturing buckets, slots, extra graphs) and :mod:`.tuning` (per-size kernels).
"""
import logging
from typing import Optional

from ..core.records import Bucket, Graph, Key, Lease, Serves
from ..process import CAPTURE_LOCK
from .compiled import CompiledForward
from .work import add_slot, capture_all, capture_into, lease_graphs, return_graphs
from .worker import Worker

logger = logging.getLogger("graphwrap")


class Capturer:
    """The one owner of capture state, and the only writer of a bucket's graphs and of what
    serves it (``Bucket.serves``); one per engine.

    It holds the compiled forward (or why ``compile=`` was given up), the tuner's per-size
    compile, the background worker and what it is doing, and the module buffers the forward
    writes. The engine's graph pool and the graphs dropped for the memory budget are in
    ``engine.store`` (so a finalizer frees them), written only here. The engine calls the
    methods below; the functions of :mod:`.work` (and of ``budget``, ``racing`` and ``tuning``)
    are their work, and take the engine for its lock, store and grid.
    """

    def __init__(self, engine):
        self.engine = engine
        self.worker = Worker(engine)
        self.compiled: Optional[CompiledForward] = None
        self.compile_off: Optional[str] = None
        self.static_forward: Optional[CompiledForward] = None  # the tuner's per-size compile
        self.background_state = self.background_error = self.tuning_error = None
        self.writes: Optional[tuple] = None  # the module buffers its forward writes, once a capture saw it

    def claim(self, ks: Key, size: int, S, may_capture: bool):
        """Bucket ``(size, S)`` of ``ks`` (made on first use), and whether the caller is to capture
        it now: then it is marked as capturing, and calls meanwhile run eagerly. The caller
        holds the engine's lock."""
        b = ks.buckets.get((size, S))
        if b is None:
            b = ks.buckets[(size, S)] = Bucket(size, S)
        if may_capture and b.serves is Serves.NOTHING:
            b.serves = Serves.CAPTURING
            return b, True
        return b, False

    def capture(self, ks: Key, b: Bucket, leaves, n: int, L) -> Optional[Bucket]:
        """A graph for bucket ``b`` (claimed), off the lock; ``b`` if it serves now."""
        return capture_into(self.engine, ks, b, leaves, n, L)

    def capture_key(self, ks: Key, sample, n: int, L, background: bool) -> Optional[dict]:
        """Every bucket of ``ks``, largest first; with ``background``, on the worker (None)."""
        if not background:
            return capture_all(self.engine, ks, sample, n, L, False)
        with self.engine.lock:
            ks.warming = True
            self.background_state = "capturing the plain forward"
        self.worker.submit(capture_all, ks, sample, n, L, True)
        return None

    def lease(self, plan, count: int) -> Optional[Lease]:
        return lease_graphs(self.engine, plan, count)

    def give_back(self, lease: Lease):
        return_graphs(self.engine, lease)

    def hot(self):
        """A bucket with shared compiled kernels served the calls that make tuning it worth it."""
        from .tuning import tune_next

        if self.compile_off is None:
            self.worker.submit(tune_next)

    def grow(self, graph: Graph, later: bool = False):
        """Another owned-output slot for ``graph``, whose slots were all held. Its fill is a
        capture: made in this thread when no capture runs in the process (the caller holds no
        lock of the engine's), else, or with ``later``, by the worker, so a call never waits for
        another module's capture or compile."""
        if self.writes is not None:  # a slot's checks run the forward: not beside calls that write state
            graph.ring.wanted = graph.ring.growing = False
            return
        if not later and CAPTURE_LOCK.acquire(blocking=False):
            try:
                add_slot(self.engine, graph, self.engine.epoch)
            finally:
                CAPTURE_LOCK.release()
        else:
            self.worker.submit(add_slot, graph, self.engine.epoch)

    def cancel(self):
        self.worker.cancel()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self.worker.wait(timeout)
