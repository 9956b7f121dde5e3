"""Serving many callers: requests joined along the batch into one call of the engine.

There is no thread of the batcher's own in the way of a lone blocking request: a caller that
finds the batcher idle runs its request at once. Requests that come meanwhile queue up; the
queue (:mod:`graphwrap.loops.request_queue`) is served by a caller that blocks anyway, by the event loop of
asyncio callers, or by the queue's worker thread for requests nobody waits on in a thread
(``submit`` returns at once). Requests of one input signature are joined along the batch,
those of different lengths padded to a common length where the measured cost says so.
"""

import asyncio
import concurrent.futures
import threading
import time
import weakref
from typing import Any, Optional

import torch

from ..core.tree import map_tensors
from ..errors import GraphwrapError
from .request_queue import Request, RequestQueue


def _close_queue(q: RequestQueue):
    """A dropped Batcher: refuse new requests, let the worker finish what is queued and end."""
    with q.lock:
        q.closed = True
        q.cond.notify_all()


class Batcher:
    """Joins concurrent requests into one call of a :class:`graphwrap.GraphedModule`.

    ``batcher(*args, **kwargs)`` blocks and returns what ``gm(*args, **kwargs)`` returns for
    these inputs; ``submit(...)`` queues the request and returns a
    :class:`concurrent.futures.Future` at once; ``await batcher.acall(...)`` serves asyncio code
    without a thread per request. Requests with the same input signature are joined along the
    batch into one call of at most ``max_batch_size`` rows (default: the largest bucket); other
    signatures queue apart, and a request above that size is served alone (chunked as ``gm``
    would). With ``GraphedModule(seq_dim=...)``, requests of different lengths are joined
    too: padded to a common length, one call per sequence bucket or padded into a longer one,
    whichever the buckets' measured replay times say is cheaper.

    Each request gets its own rows of every batched output (views of one joined output that
    nothing else writes) and its own copy of every unbatched tensor output, equal to what it
    would get alone to the tolerance of different batch sizes. Requests of a signature are
    joined only once a probe has shown that joining gives each request what it gets alone;
    until then, and for signatures that run eagerly for a reason other than the lack of CUDA,
    each request runs alone.

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
                 max_queue: int = 4096) -> None:
        engine = getattr(gm, "engine", None)
        if engine is None:
            raise GraphwrapError(f"Batcher serves a graphwrap.GraphedModule, got {type(gm).__name__}")
        if (not isinstance(max_delay_ms, (int, float)) or isinstance(max_delay_ms, bool)
                or not 0 <= max_delay_ms < float("inf")):
            raise GraphwrapError(f"max_delay_ms must be a finite number >= 0, got {max_delay_ms!r}")
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool)
                                           or max_batch_size < 1):
            raise GraphwrapError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        if not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 1:
            raise GraphwrapError(f"max_queue must be a positive int, got {max_queue!r}")
        self.gm = gm
        self.engine = engine
        self.max_delay = max_delay_ms / 1e3
        self._q = RequestQueue(engine, self.max_delay, max_batch_size, max_queue)
        weakref.finalize(self, _close_queue, self._q)

    @property
    def max_rows(self) -> int:
        return self._q.max_rows

    # ------------------------------------------------------------------ callers

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        q = self._q
        idle = False
        if not self.max_delay:  # a lone request's path: straight to the module, no queue
            with q.lock:
                if q.closed:
                    q.check_open()
                if not q.busy:
                    q.busy = idle = True
                    q.requests += 1
        if idle:
            value, error = self._run_idle(args, kwargs)
            if error is not None:
                raise error
            return value
        req = Request(args, kwargs, self.engine.joins.member(args, kwargs))
        req.waiter = threading.Lock()
        req.waiter.acquire()
        if q.enqueue(req, block=True, timeout=None):
            q.serve_queue(req)
        while not req.done:
            req.waiter.acquire()
            if req.lead:  # promoted: serve the queue (until this request is answered, if it is not yet)
                req.lead = False
                q.serve_queue(None if req.done else req)
        if req.error is not None:
            raise req.error
        return req.value

    def submit(self, *args: Any, block: bool = True, timeout: Optional[float] = None,
               **kwargs: Any) -> "concurrent.futures.Future[Any]":
        """Queue a request and return at once; its Future holds the result. Past ``max_queue``
        waiting requests this blocks (``block=False``: raises :class:`GraphwrapError`;
        ``timeout``: raises after it). ``block`` and ``timeout`` are the batcher's own: the
        module never sees them."""
        req = Request(args, kwargs, self.engine.joins.member(args, kwargs))
        req.future = concurrent.futures.Future()
        if self._q.enqueue(req, block=block, timeout=timeout):
            with self._q.lock:
                self._q.hand_over()  # nobody waits in this thread: the worker serves
        return req.future

    async def acall(self, *args: Any, **kwargs: Any) -> Any:
        """The result of the request, for asyncio code; the event loop serves the queue."""
        loop = asyncio.get_running_loop()
        req = Request(args, kwargs, self.engine.joins.member(args, kwargs))
        req.future = loop.create_future()
        req.loop = loop
        while True:
            lead = self._q.enqueue(req, block=False, timeout=None, room=loop)
            if lead is not None:
                break
            await req.future  # resolved with None once there is room
            req.future = loop.create_future()
        if lead:
            loop.call_soon(self._q.serve_in_loop, loop)
        return await req.future

    def close(self, timeout: Optional[float] = 60.0) -> None:
        """Refuse new requests and serve every queued one; those still queued after ``timeout``
        seconds (a serving event loop that stopped, say) fail with :class:`GraphwrapError`."""
        q = self._q
        with q.lock:
            q.closed = True
            lead = not q.busy and q.pending > 0
            if lead:
                q.busy = True
        if lead:
            q.serve_queue(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        with q.lock:
            while q.busy or q.pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                q.cond.wait(left)
        stranded = q.strand_queued()
        err = GraphwrapError("the Batcher was closed before this request was served")
        for r in stranded:
            r.value, r.error = None, err
        from .request_queue import deliver
        deliver(stranded)

    def __enter__(self) -> "Batcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict:
        """Requests, module calls (a joined call counts one, each request served alone one, a
        probe's joined call one), joined calls and their rows, queue wait and service time
        percentiles in milliseconds (over the last 100,000 requests)."""
        return self._q.stats()

    # ------------------------------------------------------------------ a lone request

    def _run_idle(self, args, kwargs):
        """A request that found the batcher idle: straight to the module. Requests that came
        meanwhile are served next (by a caller waiting for them, or the worker)."""
        q = self._q
        t0 = time.perf_counter()
        value = error = None
        try:
            value = self.engine.call(args, kwargs)
            if not self.engine.clone:
                value = map_tensors(torch.clone, value)
        except Exception as e:  # noqa: BLE001 - the request's own error, raised to its caller
            error = e
        t1 = time.perf_counter()
        with q.lock:
            q.calls += 1
            q.alone_calls += 1
            q.waits.append(0.0)
            q.services.append(t1 - t0)
            if q.queues:
                q.hand_over()
            else:
                q.busy = False
                if q.closed:  # close() waits for the serving role to be free; nobody else does
                    q.cond.notify_all()
        return value, error
