"""The HTTP side's handle on a shared decode batch in a child process (:mod:`.engine_process`
says why, and what crosses the pipe).

A thread of this process reads the child's messages and hands each sequence its tokens; the
event loop writes requests and cancellations. If the child dies, every sequence in flight ends
with :class:`~.engines.EngineGone`, new ones are refused with it, and ``gone()`` says why (the
HTTP app answers 503, ``/health`` too).
"""

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from ...errors import GraphwrapError
from . import engine_process
from .engines import Ended, EngineGone, Feed, ModelInfo, queue_error

logger = logging.getLogger("graphwrap.serve")
STATS_TIMEOUT = 10.0  # seconds a stats() waits for the child


class _Result(concurrent.futures.Future):
    """A sequence's end; ``cancel()`` frees its row in the child (at the batch's next step)."""

    def __init__(self, remote: "Remote", rid: int):
        super().__init__()
        self.remote, self.rid = remote, rid

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        self.remote._forget(self.rid)
        return True


@dataclass(slots=True)
class _Seq:
    feed: Feed
    queued: concurrent.futures.Future
    result: _Result


class Remote:
    """The batch of ``python -m graphwrap serve ARGS`` (an ``argparse.Namespace``), made in a
    child process; returns once the child has made it (or raises what failed there). ``entry``
    is the child's code (:func:`.engine_process.run`, or a function of a module the child can
    import that ends in it)."""

    attached = False  # (connect: another HTTP process's, over the engine's socket; it started no process)
    shared = False  # (one of several engines behind the server, --data-parallel: the others serve on if it ends)

    def __init__(self, args, log_level: str = "info", entry: Callable[..., None] = engine_process.run):
        ctx = multiprocessing.get_context("spawn")  # (CUDA cannot be forked; the parent never touches it)
        self.conn, child = ctx.Pipe()
        self.proc: Any = ctx.Process(target=entry, args=(child, args, log_level), name="graphwrap-engine")
        self.proc.start()
        child.close()
        self._attach(self._first())

    @classmethod
    def connect(cls, address: Any, key: bytes) -> "Remote":
        """Another HTTP process's handle on the batch of an engine process that a server started
        (``--api-servers``, :mod:`.fronts`): over the engine's local socket; its ``close()``
        detaches (its calls cancelled), the batch serving on."""
        from multiprocessing.connection import Client

        self = cls.__new__(cls)
        self.conn, self.proc, self.attached = Client(address, authkey=key), None, True
        kind, what = self.conn.recv()
        if kind != "ready":
            raise GraphwrapError(f"the engine process refused this HTTP process:\n{what}")
        self._attach(what)
        return self

    def _attach(self, ready: Dict[str, Any]):
        self.info = ModelInfo(ready["eos"], ready["generation"], ready.get("vocab"))
        self.context: int = ready["context"]
        self.fronts: Optional[tuple] = ready.get("fronts")  # (address, key) for other HTTP processes
        self.send_lock = threading.Lock()  # one writer at a time on the pipe
        self.join_lock = threading.Lock()  # one thread at a time waits for the child (two would race to reap it)
        self.lock = threading.Lock()  # guards seqs, asks and dead
        self.seqs: Dict[int, _Seq] = {}
        self.asks: Dict[int, concurrent.futures.Future] = {}
        self.ids = itertools.count()
        self.dead: Optional[str] = None
        self.closing = False
        self.closed: concurrent.futures.Future = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._receive, name="graphwrap-engine-receive", daemon=True)
        self.thread.start()

    def _first(self) -> Dict[str, Any]:
        assert self.proc is not None
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise GraphwrapError(f"the engine process exited (code {self.proc.exitcode}) before its batch was "
                                     "made: its log above says why")
        try:
            kind, what = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise GraphwrapError(f"the engine process exited (code {self.proc.exitcode}) before its batch was made: "
                                 "its log above says why") from None
        if kind != "ready":
            self.proc.join(5)
            raise GraphwrapError(f"the engine process failed to load the model or make its batch:\n{what}")
        return what

    # ------------------------------------------------------------------ the event loop's side

    def gone(self) -> Optional[str]:
        return self.dead

    async def queue(self, ids: List[int], kwargs: Dict[str, Any], seed: Optional[int],
                    feed: Feed) -> concurrent.futures.Future:
        """The sequence queued in the child: a future of its :class:`Ended`. Raises QueueFull,
        Closed, Unservable or EngineGone as the child answers."""
        rid = next(self.ids)
        seq = _Seq(feed, concurrent.futures.Future(), _Result(self, rid))
        with self.lock:
            if self.dead is not None:
                raise EngineGone(self.dead)
            self.seqs[rid] = seq
        try:
            self._send(("submit", rid, ids, kwargs, seed, getattr(feed, "logprobs", None)))
        except EngineGone:
            with self.lock:
                self.seqs.pop(rid, None)
            raise
        try:
            await asyncio.wrap_future(seq.queued)
        except asyncio.CancelledError:
            seq.result.cancel()
            raise
        return seq.result

    def _forget(self, rid: int):
        """A sequence cancelled here: its tokens from now on are dropped, its row freed there."""
        with self.lock:
            gone = self.seqs.pop(rid, None) is None or self.dead is not None
        if not gone:
            try:
                self._send(("cancel", rid))
            except EngineGone:  # (the child is gone: nothing of the sequence is left there)
                pass

    def stats(self) -> dict:
        """The child's ``stats()`` (waits for it: not for the event loop's own thread)."""
        qid = next(self.ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            if self.dead is not None:
                return {}
            self.asks[qid] = fut
        self._send(("stats", qid))
        try:
            return fut.result(STATS_TIMEOUT)
        except (concurrent.futures.TimeoutError, EngineGone):
            with self.lock:
                self.asks.pop(qid, None)
            return {}

    def close(self, cancel: bool = True, timeout: Optional[float] = None) -> bool:
        """Close the child's batch (``cancel``: sequences not started are cancelled) and wait for
        the child to exit; whether it ended within ``timeout`` (then it is killed)."""
        self.closing = True
        done = False
        if self.dead is None:
            try:
                self._send(("close", cancel, timeout))
                done = bool(self.closed.result(None if timeout is None else timeout + STATS_TIMEOUT))
            except (EngineGone, OSError, concurrent.futures.TimeoutError):
                pass
        if self.attached:  # (another HTTP process's: detached)
            self.conn.close()
            return done
        if self._join(STATS_TIMEOUT) is None:
            logger.warning("the engine process did not exit: killed")
            self.proc.kill()
            self._join(STATS_TIMEOUT)
            done = False
        return done

    def _join(self, timeout: float) -> Optional[int]:
        """The child's exit code once it has exited (None if it runs on after ``timeout``; 0 where
        this process did not start it)."""
        if self.attached or self.proc is None:
            return 0
        with self.join_lock:
            self.proc.join(timeout)
            return self.proc.exitcode

    def _send(self, msg: tuple):
        try:
            with self.send_lock:
                self.conn.send(msg)
        except (OSError, EOFError, ValueError):
            raise EngineGone(self.dead or "the engine process is gone") from None

    # ------------------------------------------------------------------ the receiving thread

    def _receive(self):
        while True:
            try:
                items = self.conn.recv()
            except (EOFError, OSError):
                break
            for item in items:
                self._take(item)
        self._died()

    def _take(self, item: tuple):
        op = item[0]
        if op == "T":
            seqs = self.seqs
            lps = item[3] if len(item) > 3 else None
            for i, (rid, token) in enumerate(zip(item[1], item[2])):
                seq = seqs.get(rid)
                if seq is not None:
                    seq.feed.add([token]) if lps is None or lps[i] is None else seq.feed.add([token], [lps[i]])
        elif op == "t":
            seq = self.seqs.get(item[1])
            if seq is not None:
                seq.feed.add(item[2]) if len(item) < 4 else seq.feed.add(item[2], item[3])
        elif op == "c":
            seq = self.seqs.get(item[1])
            cached = getattr(seq.feed, "cached", None) if seq is not None else None
            if cached is not None:
                cached(item[2])
        elif op == "e":
            with self.lock:
                seq = self.seqs.pop(item[1], None)
            if seq is not None:
                seq.feed.end()
                _settle(seq.queued, None)  # (its end can come before the word that it was queued)
                error = item[4]
                _settle(seq.result, Ended(item[2], item[3]) if error is None else queue_error(*error))
        elif op == "q":
            if item[2] is None:
                seq = self.seqs.get(item[1])
            else:  # refused: nothing more comes for it
                with self.lock:
                    seq = self.seqs.pop(item[1], None)
            if seq is not None:
                _settle(seq.queued, None if item[2] is None else queue_error(*item[2]))
        elif op == "s":
            with self.lock:
                fut = self.asks.pop(item[1], None)
            if fut is not None:
                _settle(fut, item[2])
        elif op == "closed":
            _settle(self.closed, item[1])

    def _died(self):
        why = (f"the engine process ended (exit code {self._join(STATS_TIMEOUT)})" if not self.attached
               else "the engine process's connection ended")
        with self.lock:
            self.dead = why
            seqs, self.seqs = self.seqs, {}
            asks, self.asks = self.asks, {}
        if not self.closing and self.shared:
            logger.error("%s: its %d sequences in flight fail", why, len(seqs))
        elif not self.closing:
            logger.error("%s: the %d sequences in flight fail, and every new request is refused (503); restart the "
                         "server", why, len(seqs))
        gone = EngineGone(why)
        for seq in seqs.values():
            seq.feed.end()
            _settle(seq.queued, gone)
            _settle(seq.result, gone)
        for fut in asks.values():
            _settle(fut, gone)
        _settle(self.closed, False)


def _settle(fut: concurrent.futures.Future, value: Any):
    """Set a future's result (or exception, where ``value`` is one), unless it is done already."""
    try:
        if isinstance(value, BaseException):
            fut.set_exception(value)
        else:
            fut.set_result(value)
    except concurrent.futures.InvalidStateError:  # cancelled meanwhile
        pass
