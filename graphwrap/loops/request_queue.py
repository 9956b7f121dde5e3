"""The Batcher's queue: requests by input signature, the batches taken from it, and who serves them.

Whoever finds the queue idle takes the serving role: a caller that blocks anyway, the event loop
of an asyncio caller, or the queue's worker thread (for requests that nobody waits on in a
thread: ``submit``). The role-holder takes every queued request of the oldest signature (up to
the row limit), splits them into calls by length (``joins.plan_groups``), serves each call,
and hands the role on once its own request is answered. The worker waits on a condition with
nothing to do (no polling) and holds the queue, not the Batcher: a Batcher that is dropped is
closed, and its worker ends once the queue is served.
"""

import asyncio
import collections
import statistics
import threading
import time
from typing import Any, Deque, Dict, List, Optional, cast

import torch

from ..core.records import Member
from ..core.tree import map_tensors
from ..errors import GraphwrapError
from ..process import REQUEST_SEQ
from .joins import join_leaves, plan_groups, probe, split_outputs
from .staging import Stager

_STATS_WINDOW = 100_000


class Request:
    __slots__ = ("args", "kwargs", "member", "group", "n", "L", "seq", "t_submit", "t_start", "done", "value",
                 "error", "waiter", "lead", "future", "loop")

    def __init__(self, args, kwargs, member):
        self.args, self.kwargs = args, kwargs
        self.seq = next(REQUEST_SEQ)
        self.group: Any  # the member's key, or ("alone", seq)
        if type(member) is not Member:  # an Eager reason: the request runs alone
            self.member, self.group, self.n, self.L = None, ("alone", self.seq), 0, None
        else:
            self.member, self.group, self.n, self.L = member, member.key, member.n, member.L
        self.t_submit = time.perf_counter()
        self.t_start = 0.0
        self.done = False
        self.value = self.error = None
        self.waiter = None  # a held lock a blocked caller waits on (released when done or promoted)
        self.lead = False  # promoted: the waiting caller serves the queue next
        self.future = None  # concurrent.futures.Future, or an asyncio future of ``loop``
        self.loop = None


class RequestQueue:
    """Pending requests, the serving role, the worker, and the counts behind ``stats()``."""

    def __init__(self, engine, max_delay: float, max_rows: Optional[int], max_queue: int):
        self.engine, self.max_delay, self._max_rows, self.max_queue = engine, max_delay, max_rows, max_queue
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.queues: Dict[Any, Deque[Request]] = {}
        self.rows: Dict[Any, int] = {}
        self.pending = 0
        self.busy = False
        self.closed = False
        self.worker: Optional[threading.Thread] = None
        self.worker_go = False
        self.space_waiters: List[Any] = []  # (loop, future) of acall callers waiting for room
        self.staging: Dict[Any, Stager] = {}
        self.requests = self.calls = self.joined = self.alone_calls = self.probes = self.joined_rows = 0
        self.waits: Deque[float] = collections.deque(maxlen=_STATS_WINDOW)
        self.services: Deque[float] = collections.deque(maxlen=_STATS_WINDOW)

    @property
    def max_rows(self) -> int:
        top = self.engine.grid.top(None)
        return top if self._max_rows is None else min(self._max_rows, top)

    def check_open(self):
        if self.closed:
            raise GraphwrapError("the Batcher is closed; make a new one to serve more requests")

    def enqueue(self, req: Request, block: bool, timeout: Optional[float], room=None) -> Optional[bool]:
        """Queue ``req``; True if the caller now holds the serving role (the queue was idle).
        With ``room`` (an event loop) and a full queue: None, and ``req.future`` resolves when
        there is room."""
        with self.lock:
            self.check_open()
            if self.pending >= self.max_queue:
                if room is not None:
                    self.space_waiters.append((room, req.future))
                    return None
                if not block:
                    raise GraphwrapError(f"the Batcher's queue is full ({self.max_queue} requests wait); "
                                         "retry later, or pass a larger max_queue=")
                if not self.cond.wait_for(lambda: self.pending < self.max_queue or self.closed, timeout):
                    raise GraphwrapError(f"the Batcher's queue stayed full for {timeout} s")
                self.check_open()
            q = self.queues.get(req.group)
            if q is None:
                q = self.queues[req.group] = collections.deque()
                self.rows[req.group] = 0
            q.append(req)
            self.rows[req.group] += req.n or 1
            self.pending += 1
            self.requests += 1
            if self.max_delay and self.rows[req.group] >= self.max_rows:
                self.cond.notify_all()  # a leader waiting for a full batch
            if self.busy:
                return False
            self.busy = True
            return True

    # ------------------------------------------------------------------ taking batches

    def take(self, wait: bool):
        """The next calls: the oldest request's signature, as many of its requests as fit,
        split into calls. A list of lists of requests, a number of seconds to wait (``max_delay``
        and not ``wait``), or None when the queue is empty. The caller holds the lock."""
        while True:
            if not self.queues:
                return None
            group = min(self.queues, key=lambda g: self.queues[g][0].seq)
            q = self.queues[group]
            if self.max_delay and type(group) is not tuple and not self.closed:  # ("alone", seq): no wait
                left = q[0].t_submit + self.max_delay - time.perf_counter()
                if left > 0 and self.rows[group] < self.max_rows:
                    if not wait:
                        return left
                    self.cond.wait(left)
                    continue
            batch = [q.popleft()]
            rows = batch[0].n
            while q and rows + q[0].n <= self.max_rows:
                r = q.popleft()
                batch.append(r)
                rows += r.n
            self.rows[group] -= sum(r.n or 1 for r in batch)
            if not q:
                del self.queues[group]
                del self.rows[group]
            self.pending -= len(batch)
            if self.space_waiters or self.max_queue <= self.pending + len(batch):
                self.cond.notify_all()
                self.wake_space_waiters()
            return self._split(batch)

    def _split(self, batch: List[Request]) -> List[List[Request]]:
        if len(batch) == 1 or batch[0].member is None or not batch[0].member.key.has_seq:
            return [batch]
        ks, eng = batch[0].member.key, self.engine
        groups = plan_groups([r.n for r in batch], [r.L for r in batch],
                             lambda L: eng.grid.seq_for(L, exact=ks.exact is not None) or L,
                             lambda S: min(self.max_rows, eng.joins.max_rows(ks, S)), lambda rows, S: eng.joins.cost(ks, rows, S))
        return [[batch[i] for i in g] for g in groups]

    def wake_space_waiters(self):
        waiters, self.space_waiters = self.space_waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(set_if_pending, fut, None, None)

    # ------------------------------------------------------------------ the serving role

    def serve_queue(self, me: Optional[Request]):
        """Serve calls until the queue is empty, or until ``me`` is answered and another caller
        takes over. The caller holds the serving role."""
        try:
            self._serve_until(me)
        except BaseException as e:  # a fault of the batcher itself: fail what waits, never hang
            stranded = self.strand()
            for r in stranded:
                r.value, r.error = None, e
            deliver(stranded)
            raise

    def strand(self) -> List[Request]:
        """Empty the queue and release the role; the requests that were queued."""
        stranded = self.strand_queued()
        with self.lock:
            self.busy = False
            self.cond.notify_all()
        return stranded

    def strand_queued(self) -> List[Request]:
        """Empty the queue; the requests that were queued."""
        with self.lock:
            stranded = [r for q in self.queues.values() for r in q]
            self.queues.clear()
            self.rows.clear()
            self.pending = 0
            self.cond.notify_all()
        return stranded

    def _serve_until(self, me: Optional[Request]):
        while True:
            with self.lock:
                calls = self.take(wait=True)
                if calls is None:
                    self.busy = False
                    self.cond.notify_all()
                    return
            for batch in calls:
                self.serve(batch)
            if me is not None and me.done:
                with self.lock:
                    if not self.queues:
                        self.busy = False
                        self.cond.notify_all()
                        return
                    self.hand_over()
                return

    def hand_over(self):
        """Give the serving role to the oldest queued caller blocked in a thread, or the worker.
        The caller holds the lock and the role."""
        waiting = [r for q in self.queues.values() for r in q if r.waiter is not None and r.loop is None]
        if waiting:
            nxt = min(waiting, key=lambda r: r.seq)
            nxt.lead = True
            cast(threading.Lock, nxt.waiter).release()
            return
        self.worker_go = True
        if self.worker is None or not self.worker.is_alive():
            self.worker = threading.Thread(target=self._work, name="graphwrap-batcher", daemon=True)
            self.worker.start()
        self.cond.notify_all()

    def _work(self):
        while True:
            with self.lock:
                while not self.worker_go:
                    if self.closed and not self.busy:
                        return
                    self.cond.wait()
                self.worker_go = False
                if not self.pending:
                    self.busy = False
                    self.cond.notify_all()
                    continue
            self.serve_queue(None)

    def serve_in_loop(self, loop):
        """One call served from an event loop; the next after the loop's other ready work."""
        with self.lock:
            calls = self.take(wait=False)
            if calls is None:
                self.busy = False
                self.cond.notify_all()
                return
            if not isinstance(calls, list):
                loop.call_later(calls, self.serve_in_loop, loop)
                return
        for batch in calls:
            self.serve(batch)
        with self.lock:
            if not self.queues:
                self.busy = False
                self.cond.notify_all()
                return
        loop.call_soon(self.serve_in_loop, loop)

    # ------------------------------------------------------------------ one call

    def serve(self, batch: List[Request]):
        t0 = time.perf_counter()
        for r in batch:
            r.t_start = t0
        try:
            ks = batch[0].member.key if batch[0].member is not None else None
            if len(batch) == 1 or ks is None or ks.failed is not None or ks.join_refused is not None:
                self.alone(batch)
            elif ks.join is not None:
                self.joined_call(batch)
            else:
                self.probe(batch)
        except BaseException as e:  # noqa: BLE001 - every request ends with a result or an error
            for r in batch:
                if not r.done and r.value is None and r.error is None:
                    r.error = e
        deliver(batch)
        t1 = time.perf_counter()
        with self.lock:
            for r in batch:
                self.waits.append(r.t_start - r.t_submit)
                self.services.append(t1 - r.t_start)

    def alone(self, batch):
        owned = self.engine.clone
        for r in batch:
            try:
                value = self.engine.call(r.args, r.kwargs)
                if not owned:  # outputs="view": views of static outputs that the next call overwrites
                    value = map_tensors(torch.clone, value)
            except Exception as e:  # noqa: BLE001 - the request's own error
                r.value, r.error = None, e
            else:
                r.value, r.error = value, None
        with self.lock:
            self.alone_calls += len(batch)
            self.calls += len(batch)

    def joined_call(self, batch):
        ks = batch[0].member.key
        kinds, seq_dims, spec = ks.join
        sizes, lengths = [r.n for r in batch], [r.L for r in batch]
        L = max(lengths) if ks.has_seq else None
        try:
            outs = self.engine.joins.run_joined(ks, self.join(batch, L), sum(sizes), L)
        except Exception:  # noqa: BLE001 - some request made the module raise: each runs alone
            outs = None
        if outs is None or ks.failed is not None:
            self.alone(batch)
            return
        for r, value in zip(batch, split_outputs(outs, kinds, seq_dims, spec, sizes, lengths, self.engine.batch_dim)):
            r.value, r.error = value, None
        with self.lock:
            self.joined += 1
            self.calls += 1
            self.joined_rows += sum(sizes)

    def probe(self, batch):
        """Serve each request alone, then joined once: if each got the same, join from now on."""
        self.alone(batch)
        if any(r.error is not None for r in batch):
            return
        ks = batch[0].member.key
        lengths = [r.L for r in batch]
        joined = self.join(batch, max(lengths) if ks.has_seq else None)
        if probe(self.engine, ks, None, [r.n for r in batch], lengths, [r.value for r in batch], joined):
            with self.lock:
                self.probes += 1
                self.calls += 1

    def join(self, batch, L) -> List[torch.Tensor]:
        """The batch's inputs joined along the batch (padded to ``L``); host inputs through pinned
        memory and one asynchronous copy per input on the engine's copy stream, for a key on a GPU."""
        ks = batch[0].member.key
        columns = list(zip(*(r.member.leaves for r in batch)))
        if ks.seen_as is None or ks.device.type != "cuda" or all(col[0].device == ks.device for col in columns):
            return join_leaves(columns, ks.roles, L)
        return self._join_to_device(ks, columns, L)

    def _join_to_device(self, ks, columns, L):
        engine, device = self.engine, ks.device
        compute = torch.cuda.current_stream(device)
        copy_stream = engine.copy_stream(device)
        st = self.staging.get(ks)
        if st is None:
            st = self.staging[ks] = Stager()
        turn = st.take()
        st.wait_host(turn)  # the copy that read this pinned set two calls ago is over
        out = []
        for j, (col, role) in enumerate(zip(columns, ks.roles)):
            if col[0].device == device:
                out.append(join_leaves([col], [role], L)[0])
                continue
            shape = list(col[0].shape)
            bd, sd, _ = role
            shape[bd] = sum(t.shape[bd] for t in col)
            if sd is not None and L is not None:
                shape[sd] = L
            buf, _ = st.buffer(turn, j, shape, col[0].dtype, bd)
            host = join_leaves([col], [role], L, out=[buf])[0]
            with torch.cuda.stream(copy_stream):
                dev = torch.empty(host.shape, dtype=host.dtype, device=device)
                dev.copy_(host, non_blocking=True)
            dev.record_stream(compute)
            out.append(dev)
        st.done(turn, copy_stream)
        compute.wait_stream(copy_stream)
        return out

    def stats(self) -> dict:
        with self.lock:
            waits, services = sorted(self.waits), sorted(self.services)
            return {
                "requests": self.requests,
                "module_calls": self.calls,
                "joined_calls": self.joined,
                "alone_calls": self.alone_calls,
                "probes": self.probes,
                "rows_per_joined_call": self.joined_rows / self.joined if self.joined else 0.0,
                "requests_per_call": (self.requests - self.pending) / self.calls if self.calls else 0.0,
                "queued": self.pending,
                "queue_wait_ms": _percentiles(waits),
                "service_ms": _percentiles(services),
            }


def deliver(batch: List[Request]):
    """Hand every request of the batch its answer: blocked callers wake, futures resolve, and
    each event loop gets one call for all of its requests."""
    by_loop: Dict[Any, list] = {}
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    for r in batch:
        if r.loop is not None:
            if r.loop is running:
                set_if_pending(r.future, r.value, r.error)
            else:
                by_loop.setdefault(r.loop, []).append(r)
        elif r.future is not None and not r.future.done():
            if r.error is not None:
                r.future.set_exception(r.error)
            else:
                r.future.set_result(r.value)
        r.done = True
        if r.waiter is not None:
            try:
                r.waiter.release()
            except RuntimeError:  # already released: the caller was promoted and has not woken yet
                pass
    for loop, reqs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve_all, reqs)
        except RuntimeError:  # the loop is closed: nobody awaits these any more
            pass


def set_if_pending(fut, value, error):
    if not fut.done():
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)


def _resolve_all(reqs):
    for r in reqs:
        set_if_pending(r.future, r.value, r.error)


def _percentiles(xs: List[float]) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}

    def at(q):
        return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": 1e3 * statistics.fmean(xs)}
