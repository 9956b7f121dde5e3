"""Serving many callers: requests joined along the batch into one call of the engine.

There is no thread of the batcher's own in the way of a lone request. The caller that finds
the batcher idle serves the queue itself: it takes every queued request of one input signature
(up to the largest bucket of rows), joins them along the batch, makes one call of the engine,
splits the outputs and hands each request its part, and goes on while requests keep coming.
Once its own request is answered it hands the serving over to a caller that is waiting anyway
(or, for requests nobody waits on in a thread, to one background thread), so no caller serves
others for long. Callers on an asyncio event loop queue their request and await it; the loop
serves the queue between its other work, one batch at a time, and each batch resolves the
loop's requests in one go.
"""

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import statistics
import threading
import time
from typing import Any, Deque, Dict, List, Optional

import torch

from .calls import call
from .errors import GraphwrapError
from .joining import join_leaves, join_verdict, rows_differ, split_outputs
from .tree import map_tensors

logger = logging.getLogger("graphwrap")
_SEQ = itertools.count()
_STATS_WINDOW = 100_000


class _Request:
    __slots__ = ("args", "kwargs", "group", "leaves", "n", "key", "seq", "t_submit", "t_start", "done", "value",
                 "error", "waiter", "lead", "future", "loop")

    def __init__(self, args, kwargs):
        self.args, self.kwargs = args, kwargs
        self.group = self.leaves = self.key = None
        self.n = 0
        self.seq = next(_SEQ)
        self.t_submit = time.perf_counter()
        self.t_start = 0.0
        self.done = False
        self.value = self.error = None
        self.waiter = None  # a held lock a blocked caller waits on (released when done or promoted)
        self.lead = False  # promoted: the waiting caller serves the queue next
        self.future = None  # concurrent.futures.Future, or an asyncio future of ``loop``
        self.loop = None


class Batcher:
    """Joins concurrent requests into one call of a :class:`graphwrap.GraphedModule`.

    ``batcher(*args, **kwargs)`` blocks and returns what ``gm(*args, **kwargs)`` returns for
    these inputs; ``submit(...)`` returns a :class:`concurrent.futures.Future`; ``await
    batcher.acall(...)`` serves asyncio code without a thread per request. Requests with the
    same input signature are joined along ``batch_dim`` into one call of at most
    ``max_batch_size`` rows (default: the largest bucket); other signatures queue apart, and a
    request above that size is served alone (chunked as ``gm`` would).

    Each request gets its own rows of every batched output (views of one joined output that
    nothing else writes) and its own copy of every unbatched tensor output, equal to what it
    would get alone to the tolerance of different batch sizes. Requests of a signature are
    joined only once a probe has shown that joining gives each request what it gets alone;
    until then, and for signatures that run eagerly for a reason other than the lack of CUDA
    (a failed capture, rows that mix, training mode, ``verify=False`` does not matter), each
    request runs alone.

    Args:
        gm: the GraphedModule to serve.
        max_delay_ms: 0 (default): whenever the module is free, everything queued goes, so a
            lone request never waits. Above 0: a batch waits until it fills ``max_batch_size``
            rows or its oldest request has waited this long.
        max_batch_size: the most rows of one joined call.
        max_queue: the most requests waiting; past it ``submit`` blocks (or raises with
            ``block=False``) and ``acall`` waits.

    Nothing is lost: every request ends with its result or an exception. A request that makes
    the module raise fails alone (the others of its batch are run again one by one). After
    :meth:`close`, queued requests are still served and new ones get a :class:`GraphwrapError`.
    """

    def __init__(self, gm, *, max_delay_ms: float = 0.0, max_batch_size: Optional[int] = None,
                 max_queue: int = 4096):
        engine = getattr(gm, "engine", None)
        if engine is None:
            raise GraphwrapError(f"Batcher serves a graphwrap.GraphedModule, got {type(gm).__name__}")
        if not isinstance(max_delay_ms, (int, float)) or isinstance(max_delay_ms, bool) or max_delay_ms < 0:
            raise GraphwrapError(f"max_delay_ms must be a number >= 0, got {max_delay_ms!r}")
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool)
                                           or max_batch_size < 1):
            raise GraphwrapError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        if not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 1:
            raise GraphwrapError(f"max_queue must be a positive int, got {max_queue!r}")
        self.gm = gm
        self.engine = engine
        self.max_delay = max_delay_ms / 1e3
        self._max_rows = max_batch_size
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queues: Dict[Any, Deque[_Request]] = {}
        self._rows: Dict[Any, int] = {}
        self._pending = 0
        self._busy = False
        self._closed = False
        self._worker: Optional[threading.Thread] = None
        self._worker_go = False
        self._space_waiters: List[Any] = []  # (loop, future) of acall callers waiting for room
        self._staging: Dict[Any, list] = {}  # group -> pinned buffers for joined host inputs
        # stats
        self._requests = self._calls = self._joined = self._alone_calls = self._probes = 0
        self._joined_rows = 0
        self._waits: Deque[float] = collections.deque(maxlen=_STATS_WINDOW)
        self._services: Deque[float] = collections.deque(maxlen=_STATS_WINDOW)

    @property
    def max_rows(self) -> int:
        top = self.engine.table.max
        return top if self._max_rows is None else min(self._max_rows, top)

    # ------------------------------------------------------------------ callers

    def __call__(self, *args, **kwargs):
        idle = False
        if not self.max_delay:  # _take_idle, inlined: this is every lone request's path
            with self._lock:
                if self._closed:
                    self._check_open()
                if not self._busy:
                    self._busy = idle = True
                    self._requests += 1
        if idle:
            value, error = self._run_idle(args, kwargs)
            if error is not None:
                raise error
            return value
        req = self._request(args, kwargs)
        req.waiter = threading.Lock()
        req.waiter.acquire()
        if self._enqueue(req, block=True, timeout=None):
            self._serve_queue(req)
        while not req.done:
            req.waiter.acquire()
            if req.lead:  # promoted: serve the queue (until this request is answered, if it is not yet)
                req.lead = False
                self._serve_queue(None if req.done else req)
        if req.error is not None:
            raise req.error
        return req.value

    def submit(self, *args, block: bool = True, timeout: Optional[float] = None, **kwargs) -> concurrent.futures.Future:
        """Queue a request; its Future holds the result. Past ``max_queue`` waiting requests this
        blocks (``block=False``: raises :class:`GraphwrapError`; ``timeout``: raises after it).
        ``block`` and ``timeout`` are the batcher's own: the module never sees them."""
        if self._take_idle():
            fut = concurrent.futures.Future()
            value, error = self._run_idle(args, kwargs)
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)
            return fut
        req = self._request(args, kwargs)
        req.future = concurrent.futures.Future()
        if self._enqueue(req, block=block, timeout=timeout):
            self._serve_queue(req)
        return req.future

    async def acall(self, *args, **kwargs):
        """The result of the request, for asyncio code; the event loop serves the queue."""
        loop = asyncio.get_running_loop()
        req = self._request(args, kwargs)
        req.future = loop.create_future()
        req.loop = loop
        while True:
            lead = self._enqueue(req, block=False, timeout=None, room=loop)
            if lead is not None:
                break
            await req.future  # resolved with None once there is room
            req.future = loop.create_future()
        if lead:
            loop.call_soon(self._serve_in_loop, loop)
        return await req.future

    def close(self, timeout: Optional[float] = 60.0):
        """Refuse new requests and serve every queued one; those still queued after ``timeout``
        seconds (a serving event loop that stopped, say) fail with :class:`GraphwrapError`."""
        with self._lock:
            self._closed = True
            lead = not self._busy and self._pending > 0
            if lead:
                self._busy = True
        if lead:
            self._serve_queue(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._busy or self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            stranded = [r for q in self._queues.values() for r in q]
            self._queues.clear()
            self._rows.clear()
            self._pending = 0
            self._cond.notify_all()
        err = GraphwrapError("the Batcher was closed before this request was served")
        for r in stranded:
            self._finish_one(r, None, err)
        self._deliver(stranded)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stats(self) -> dict:
        """Requests, module calls (a joined call counts one, each request served alone one, a
        probe's joined call one), joined calls and their rows, queue wait and service time
        percentiles in milliseconds (over the last 100,000 requests)."""
        with self._lock:
            waits, services = sorted(self._waits), sorted(self._services)
            return {
                "requests": self._requests,
                "module_calls": self._calls,
                "joined_calls": self._joined,
                "alone_calls": self._alone_calls,
                "probes": self._probes,
                "rows_per_joined_call": self._joined_rows / self._joined if self._joined else 0.0,
                "requests_per_call": (self._requests - self._pending) / self._calls if self._calls else 0.0,
                "queued": self._pending,
                "queue_wait_ms": _percentiles(waits),
                "service_ms": _percentiles(services),
            }

    # ------------------------------------------------------------------ the queue

    def _take_idle(self) -> bool:
        """Take the serving role if nobody holds it (then nothing is queued either) and no
        batch is meant to wait for others (``max_delay_ms``)."""
        if self.max_delay:
            return False
        with self._lock:
            self._check_open()
            if self._busy:
                return False
            self._busy = True
            self._requests += 1
            return True

    def _run_idle(self, args, kwargs):
        """A request that found the batcher idle: straight to the module, no queue, no hand-off.
        Requests that came meanwhile are served next (by a caller waiting for them, or the
        background thread)."""
        t0 = time.perf_counter()
        value = error = None
        try:
            value = call(self.engine, args, kwargs)
            if not self.engine.clone:
                value = map_tensors(torch.clone, value)
        except Exception as e:  # noqa: BLE001 - the request's own error, raised to its caller
            error = e
        t1 = time.perf_counter()
        with self._lock:
            self._calls += 1
            self._alone_calls += 1
            self._waits.append(0.0)
            self._services.append(t1 - t0)
            if self._queues:
                self._hand_over()
            else:
                self._busy = False
                if self._closed:  # close() waits for the serving role to be free; nobody else does
                    self._cond.notify_all()
        return value, error

    def _request(self, args, kwargs) -> _Request:
        req = _Request(args, kwargs)
        info = self.engine.join_info(args, kwargs)
        if isinstance(info, str) or info[2] > self.max_rows:
            req.group = ("alone", req.seq)
        else:
            req.group, req.leaves, req.n, req.key = info
        return req

    def _check_open(self):
        if self._closed:
            raise GraphwrapError("the Batcher is closed; make a new one to serve more requests")

    def _enqueue(self, req: _Request, block: bool, timeout: Optional[float], room=None) -> Optional[bool]:
        """Queue ``req``; True if the caller must serve the queue (the batcher was idle). With
        ``room`` (an event loop) and a full queue: None, and ``req.future`` resolves when there
        is room."""
        with self._lock:
            self._check_open()
            if self._pending >= self.max_queue:
                if room is not None:
                    self._space_waiters.append((room, req.future))
                    return None
                if not block:
                    raise GraphwrapError(f"the Batcher's queue is full ({self.max_queue} requests wait); "
                                         "retry later, or pass a larger max_queue=")
                if not self._cond.wait_for(lambda: self._pending < self.max_queue or self._closed, timeout):
                    raise GraphwrapError(f"the Batcher's queue stayed full for {timeout} s")
                self._check_open()
            q = self._queues.get(req.group)
            if q is None:
                q = self._queues[req.group] = collections.deque()
                self._rows[req.group] = 0
            q.append(req)
            self._rows[req.group] += req.n or 1
            self._pending += 1
            self._requests += 1
            if self.max_delay and self._rows[req.group] >= self.max_rows:
                self._cond.notify_all()  # a leader waiting for a full batch
            if self._busy:
                return False
            self._busy = True
            return True

    def _take(self, wait: bool):
        """The next batch: the oldest request's signature, as many of its requests as fit.

        With ``max_delay_ms``, a batch that is neither full nor old enough is waited for
        (``wait``) or its remaining time is returned. Returns a list of requests, a number of
        seconds to wait, or None when the queue is empty. The caller holds the lock."""
        while True:
            if not self._queues:
                return None
            group = min(self._queues, key=lambda g: self._queues[g][0].seq)
            q = self._queues[group]
            if self.max_delay and type(group) is not tuple and not self._closed:  # ("alone", seq): no wait
                left = q[0].t_submit + self.max_delay - time.perf_counter()
                if left > 0 and self._rows[group] < self.max_rows:
                    if not wait:
                        return left
                    self._cond.wait(left)
                    continue
            batch = [q.popleft()]
            rows = batch[0].n
            while q and rows + q[0].n <= self.max_rows:
                r = q.popleft()
                batch.append(r)
                rows += r.n
            self._rows[group] -= sum(r.n or 1 for r in batch)
            if not q:
                del self._queues[group]
                del self._rows[group]
            self._pending -= len(batch)
            if self._space_waiters or self.max_queue <= self._pending + len(batch):
                self._cond.notify_all()
                self._wake_space_waiters()
            return batch

    def _wake_space_waiters(self):
        waiters, self._space_waiters = self._space_waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_set_if_pending, fut, None, None)

    def _serve_queue(self, me: Optional[_Request]):
        """Serve batches until the queue is empty, or until ``me`` is answered and another
        caller takes over. The caller holds the serving role (``_busy``)."""
        try:
            self._serve_batches(me)
        except BaseException as e:  # a fault of the batcher itself: fail what waits, never hang
            with self._lock:
                stranded = [r for q in self._queues.values() for r in q]
                self._queues.clear()
                self._rows.clear()
                self._pending = 0
                self._busy = False
                self._cond.notify_all()
            for r in stranded:
                self._finish_one(r, None, e)
            self._deliver(stranded)
            raise

    def _serve_batches(self, me: Optional[_Request]):
        while True:
            with self._lock:
                batch = self._take(wait=True)
                if batch is None:
                    self._busy = False
                    self._cond.notify_all()
                    return
            self._serve(batch)
            if me is not None and me.done:
                with self._lock:
                    if not self._queues:
                        self._busy = False
                        self._cond.notify_all()
                        return
                    self._hand_over()
                return

    def _hand_over(self):
        """Give the serving role to the oldest queued caller blocked in a thread, or the
        background thread. The caller holds the lock and the role."""
        waiting = [r for q in self._queues.values() for r in q if r.waiter is not None and r.loop is None]
        if waiting:
            nxt = min(waiting, key=lambda r: r.seq)
            nxt.lead = True
            nxt.waiter.release()
            return
        self._worker_go = True
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, name="graphwrap-batcher", daemon=True)
            self._worker.start()
        self._cond.notify_all()

    def _work(self):
        while True:
            with self._lock:
                while not self._worker_go:
                    if self._closed:
                        return
                    self._cond.wait(1.0)
                self._worker_go = False
                if not self._pending:
                    self._busy = False
                    self._cond.notify_all()
                    continue
            self._serve_queue(None)

    def _serve_in_loop(self, loop):
        """One batch served from an event loop; the next one after the loop's other ready work."""
        with self._lock:
            batch = self._take(wait=False)
            if batch is None:
                self._busy = False
                self._cond.notify_all()
                return
            if not isinstance(batch, list):
                loop.call_later(batch, self._serve_in_loop, loop)
                return
        self._serve(batch)
        with self._lock:
            if not self._queues:
                self._busy = False
                self._cond.notify_all()
                return
        loop.call_soon(self._serve_in_loop, loop)

    # ------------------------------------------------------------------ one batch

    def _serve(self, batch: List[_Request]):
        t0 = time.perf_counter()
        for r in batch:
            r.t_start = t0
        try:
            key = batch[0].key
            if len(batch) == 1 or key is None or key.failed is not None or key.join_refused is not None:
                self._alone(batch)
            elif key.join is not None:
                self._joined_call(batch)
            else:
                self._probe(batch)
        except BaseException as e:  # noqa: BLE001 - every request ends with a result or an error
            for r in batch:
                if not r.done:
                    self._finish_one(r, None, e)
        self._deliver(batch)
        t1 = time.perf_counter()
        with self._lock:
            for r in batch:
                self._waits.append(r.t_start - r.t_submit)
                self._services.append(t1 - r.t_start)

    def _alone(self, batch):
        owned = self.engine.clone
        for r in batch:
            try:
                value = call(self.engine, r.args, r.kwargs)
                if not owned:  # outputs="view": views of static outputs that the next call overwrites
                    value = map_tensors(torch.clone, value)
            except Exception as e:  # noqa: BLE001 - the request's own error
                self._finish_one(r, None, e)
            else:
                self._finish_one(r, value, None)
        with self._lock:
            self._alone_calls += len(batch)
            self._calls += len(batch)

    def _joined_call(self, batch):
        key = batch[0].key
        kinds, spec = key.join
        sizes = [r.n for r in batch]
        try:
            outs = self.engine.run_joined(key, self._join(batch), sum(sizes))
        except Exception:  # noqa: BLE001 - some request made the module raise: each runs alone
            outs = None
        if outs is None or key.failed is not None:
            self._alone(batch)
            return
        for r, value in zip(batch, split_outputs(outs, kinds, spec, sizes, self.engine.batch_dim)):
            self._finish_one(r, value, None)
        with self._lock:
            self._joined += 1
            self._calls += 1
            self._joined_rows += sum(sizes)

    def _probe(self, batch):
        """Serve each request alone, then joined once: if each got the same, join from now on."""
        self._alone(batch)
        if any(r.error is not None for r in batch):
            return
        joined = self._join(batch)
        if not rows_differ(joined, self.engine.batch_dim):
            return  # identical rows show nothing: probe again with other requests
        key = batch[0].key
        sizes = [r.n for r in batch]
        try:
            outs = self.engine.run_joined(key, joined, sum(sizes))
        except Exception as e:  # noqa: BLE001 - the module cannot take them joined
            self.engine.set_join(key, f"joined requests make the module raise: {type(e).__name__}: {e}")
            return
        if outs is None:
            return
        with self._lock:
            self._probes += 1
            self._calls += 1
        self.engine.set_join(key, join_verdict(outs, [r.value for r in batch], sizes, self.engine.batch_dim))

    def _join(self, batch) -> List[torch.Tensor]:
        """The batch's inputs joined along the batch; host inputs through pinned memory and one
        asynchronous copy per input on the engine's copy stream, for a key on a GPU."""
        bd = self.engine.batch_dim
        columns = list(zip(*(r.leaves for r in batch)))
        key = batch[0].key
        if key.seen_as is None or all(col[0].is_cuda for col in columns):
            return join_leaves(columns, bd)
        return self._join_to_device(batch[0].group, columns, key.device, bd)

    def _join_to_device(self, group, columns, device, bd):
        rows = sum(t.shape[bd] for t in columns[0])
        engine = self.engine
        compute = torch.cuda.current_stream(device)
        copy_stream = engine.copy_stream(device)
        # Two pinned buffers per input, taken in turns; one is refilled once its copy is over.
        st = self._staging.get(group)
        if st is None:
            st = self._staging[group] = [0, [None, None], [torch.cuda.Event(), torch.cuda.Event()]]
        turn = st[0]
        st[0] = 1 - turn
        st[2][turn].synchronize()
        bufs = st[1][turn]
        if bufs is None or bd != 0:
            bufs = st[1][turn] = [None] * len(columns)
        out = []
        for j, col in enumerate(columns):
            if col[0].is_cuda:
                out.append(torch.cat(list(col), bd))
                continue
            if bd == 0:
                b = bufs[j]
                if b is None or b.shape[0] < self.max_rows:
                    shape = (self.max_rows,) + tuple(col[0].shape[1:])
                    b = bufs[j] = torch.empty(shape, dtype=col[0].dtype, pin_memory=True)
                host = torch.cat(list(col), 0, out=b.narrow(0, 0, rows))
            else:
                host = torch.cat(list(col), bd).pin_memory()
                bufs[j] = host
            with torch.cuda.stream(copy_stream):
                dev = torch.empty(host.shape, dtype=host.dtype, device=device)
                dev.copy_(host, non_blocking=True)
            dev.record_stream(compute)
            out.append(dev)
        st[2][turn].record(copy_stream)
        compute.wait_event(st[2][turn])
        return out

    # ------------------------------------------------------------------ answers

    @staticmethod
    def _finish_one(r: _Request, value, error):
        r.value, r.error = value, error

    def _deliver(self, batch):
        """Hand every request of the batch its answer: blocked callers wake, futures resolve,
        and each event loop gets one call for all of its requests."""
        by_loop: Dict[Any, list] = {}
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for r in batch:
            if r.loop is not None:
                if r.loop is running:
                    _set_if_pending(r.future, r.value, r.error)
                else:
                    by_loop.setdefault(r.loop, []).append(r)
            elif r.future is not None:
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


def _set_if_pending(fut, value, error):
    if not fut.done():
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)


def _resolve_all(reqs):
    for r in reqs:
        _set_if_pending(r.future, r.value, r.error)


def _percentiles(xs: List[float]) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}

    def at(q):
        return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": 1e3 * statistics.fmean(xs)}
