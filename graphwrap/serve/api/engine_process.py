"""The shared decode batch in a process of its own (the child of :class:`~.remote.Remote`).

Why a process: the HTTP side runs Python for every token of every stream (text, events, the
socket), and in the batch's process that Python takes the interpreter from the decode thread,
so it slows the batch itself, not only the streams. Here the decode thread shares the
interpreter with nothing but the batch's own work and two threads that move messages.

Messages on the pipe, parent to child (one tuple each):
    ("submit", rid, ids, kwargs, seed, logprobs)
                                         a sequence to queue (logprobs: None, or k: each
                                         token's log-probability and the top k)
    ("cancel", rid)                      its row freed at the next step (or never queued)
    ("stats", qid)                       the batch's stats(), answered under ``qid``
    ("close", cancel, timeout)           close the batch, answer, and exit (another HTTP
                                         process's connection: its calls cancelled, answered)
Child to parent: first ("ready", info) or ("failed", traceback), then lists of items, all that
came meanwhile in one message (a decode step's tokens for every row, usually):
    ("q", rid, error)                    queued (error None) or refused (error (kind, message))
    ("t", rid, tokens[, logprobs])       new tokens of a sequence
    ("T", rids, tokens[, logprobs])      a decode turn's tokens: one for each of rids
                                         (logprobs: each token's, None where not asked)
    ("c", rid, n)                        n tokens of its prompt found in the prefix cache
    ("e", rid, count, last, error)       its end: new tokens' count and the last, or its error
    ("s", qid, stats)                    an answer to "stats"
    ("closed", done)                     the batch closed (done: its thread ended in time)
"""

import concurrent.futures
import gc
import logging
import os
import signal
import threading
import traceback
import types
from typing import Any, Dict, List, Optional, Set

from ...decoding.engine import collector
from ...decoding.engine.collector import GcClock
from .engines import SUBMITTERS, Ended, error_kind, model_eos, model_vocab

logger = logging.getLogger("graphwrap.serve")


class Outbox:
    """Items for the parent, sent by one thread, everything that came meanwhile in one message."""

    def __init__(self, conn):
        self.conn = conn
        self.cond = threading.Condition(threading.Lock())  # guards items and closed
        self.items: List[tuple] = []
        self.closed = False
        self.thread = threading.Thread(target=self._send, name="graphwrap-engine-send", daemon=True)
        self.thread.start()

    def post(self, item: tuple):
        with self.cond:
            self.items.append(item)
            if len(self.items) == 1:
                self.cond.notify()

    def put_step(self, rids: List[int], tokens: List[int], logprobs: Optional[List[Any]] = None):
        """A decode turn's tokens, one for each of ``rids``, and their log-probabilities where a
        sequence asked (called on the decode thread: a sink of the shared batch, which never
        blocks)."""
        self.post(("T", rids, tokens) if logprobs is None else ("T", rids, tokens, logprobs))

    def _send(self):
        while True:
            with self.cond:
                while not self.items and not self.closed:
                    self.cond.wait()
                if not self.items:
                    return
                items, self.items = self.items, []
            try:
                self.conn.send(items)
            except (OSError, EOFError):  # the parent is gone: nothing more to tell it
                return

    def close(self, timeout: float = 10.0):
        """Send what is left, then stop."""
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(timeout)


class _Tap:
    """A sequence's tokens into the outbox: the shared batch's through the outbox as its sink,
    a turn's tokens for every sequence in one item; any other way (a loop of one call) here."""

    __slots__ = ("out", "rid", "logprobs")

    def __init__(self, out: Outbox, rid: int, logprobs: Optional[int] = None):
        self.out, self.rid, self.logprobs = out, rid, logprobs

    @property
    def sink(self) -> Outbox:
        return self.out

    @property
    def key(self) -> int:
        return self.rid

    def add(self, tokens: List[int], logprobs: Optional[List[Any]] = None):
        self.out.post(("t", self.rid, tokens) if logprobs is None else ("t", self.rid, tokens, logprobs))

    def end(self):  # (its end goes with the call's result: ("e", ...))
        pass

    def cached(self, n: int):
        self.out.post(("c", self.rid, n))


class Worker:
    """The child's side of one connection: calls queued on ``gm``'s batch as the other end asks,
    their tokens and ends sent back. The parent's connection (``main``) owns the batch: its
    ``close``, or its end, closes it. Another HTTP process's (``--api-servers``, :mod:`.fronts`)
    only detaches: its calls are cancelled and the batch serves on."""

    def __init__(self, conn, gm, gc_clock: Optional[GcClock] = None, tokenizer: Any = None, main: bool = True,
                 peers: Optional[List["Worker"]] = None):
        from . import local  # (torch: this child's, never the server's process, which imports this module)

        self.local = local
        self.conn, self.gm, self.gc, self.tokenizer, self.main = conn, gm, gc_clock, tokenizer, main
        self.peers = peers if peers is not None else [self]  # every connection's worker (stats)
        self.submitted = 0  # requests this connection sent
        self.out = Outbox(conn)
        self.lock = threading.Lock()  # guards calls, pending and cancelled
        self.calls: Dict[int, concurrent.futures.Future] = {}
        self.pending: Set[int] = set()  # asked for, not queued yet
        self.cancelled: Set[int] = set()  # of those pending, cancelled meanwhile
        self.pool = concurrent.futures.ThreadPoolExecutor(SUBMITTERS, thread_name_prefix="graphwrap-submit")

    def serve(self):
        """Answer the parent until it asks to close or goes away."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                if not self.main:
                    logger.warning("an HTTP process went away: its %d requests in flight are cancelled",
                                   self._detach())
                    return
                logger.warning("the server's process went away: the engine closes its batch and exits")
                self.gm.close(cancel=True, timeout=10)
                return
            op = msg[0]
            if op == "submit":
                self.submitted += 1
                with self.lock:
                    self.pending.add(msg[1])
                self.pool.submit(self._submit, *msg[1:])
            elif op == "cancel":
                self._cancel(msg[1])
            elif op == "stats":
                self.out.post(("s", msg[1], self._stats()))
            elif op == "close" and not self.main:  # (another HTTP process stops: the batch serves on)
                self._detach()
                self.out.post(("closed", True))
                self.out.close()
                return
            elif op == "close":
                d = self._stats().get("decode") or {}
                logger.info("closing the batch after %s steps; the decode thread's seconds by part: %s; a token's "
                            "wait for its stream (ms): %s; its slowest turns: %s; the collector's pauses: %s",
                            d.get("steps"), d.get("thread_s"), d.get("delivery_lag_ms"), d.get("slowest_turns"),
                            self.gc and self.gc.report())
                done = self.gm.close(cancel=msg[1], timeout=msg[2])
                self.pool.shutdown(wait=False, cancel_futures=True)
                self.out.post(("closed", done))
                self.out.close()
                return

    def _stats(self) -> dict:
        try:
            stats = self.local.batch_stats(self.gm)
        except Exception:  # noqa: BLE001 - the metrics go without it; the engine serves on
            logger.exception("the batch's stats could not be read")
            return {}
        if len(self.peers) > 1:
            stats["api_servers"] = [w.submitted for w in self.peers]  # (requests each HTTP process sent)
        if self.gc is not None:
            stats["engine_gc"] = self.gc.report()
            stats["engine_frozen_objects"] = gc.get_freeze_count()
        return stats

    def _submit(self, rid: int, ids: List[int], kwargs: Dict[str, Any], seed: Optional[int],
                logprobs: Optional[int] = None):
        try:
            fut = self.local.submit(self.gm, ids, kwargs, seed, _Tap(self.out, rid, logprobs), self.tokenizer)
        except BaseException as e:  # noqa: BLE001 - the request's: answered with it
            with self.lock:
                self.pending.discard(rid)
                self.cancelled.discard(rid)
            self.out.post(("q", rid, (error_kind(e), str(e))))
            return
        with self.lock:
            self.pending.discard(rid)
            cancel = rid in self.cancelled
            self.cancelled.discard(rid)
            if not cancel:
                self.calls[rid] = fut
        self.out.post(("q", rid, None))
        fut.add_done_callback(lambda f: self._ended(rid, f))
        if cancel:
            fut.cancel()

    def _ended(self, rid: int, f: concurrent.futures.Future):
        with self.lock:
            self.calls.pop(rid, None)
        if f.cancelled():
            self.out.post(("e", rid, 0, -1, ("cancelled", "the sequence was cancelled")))
        elif f.exception() is not None:
            e = f.exception()
            self.out.post(("e", rid, 0, -1, (type(e).__name__, str(e))))
        else:
            r: Ended = f.result()
            self.out.post(("e", rid, r.count, r.last, None))

    def _detach(self) -> int:
        """Every call of this connection cancelled (its rows freed at the batch's next step), and
        no more queued: how many there were."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            calls, self.calls = list(self.calls.values()), {}
            self.cancelled |= self.pending
        for fut in calls:
            fut.cancel()
        return len(calls)

    def _cancel(self, rid: int):
        with self.lock:
            fut = self.calls.get(rid)
            if fut is None and rid in self.pending:
                self.cancelled.add(rid)
        if fut is not None:
            fut.cancel()


def sampling_of(model) -> Any:
    """What the parent reads of the model's generation config (it holds no model)."""
    gen = getattr(model, "generation_config", None)
    if gen is None:
        return None
    return types.SimpleNamespace(**{k: getattr(gen, k, None) for k in ("do_sample", "temperature", "top_p", "top_k")})


def own_gpu(args):
    """With ``--data-parallel``, this engine process sees only its own GPU (``CUDA_VISIBLE_DEVICES``,
    set before CUDA starts here), as ``cuda``: every thread of it, the batch's and Triton's, then
    works on that GPU without a device guard of its own."""
    if getattr(args, "cuda_visible", None) is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = args.cuda_visible


def run(conn, args, log_level: str = "info"):
    """The child's entry: load the model and make its batch as ``args`` say (``python -m
    graphwrap serve``'s), tell the parent, then serve it. Signals are the parent's to act on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    own_gpu(args)
    index = getattr(args, "engine_index", None)  # (--data-parallel: which engine this is)
    name = "engine" if index is None else f"engine {index}"
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s %(name)s[{name}] %(levelname)s %(message)s")
    from .loading import freeze_startup, load_here

    try:
        served = load_here(args)
    except BaseException:  # noqa: BLE001 - told to the parent, which raises it
        conn.send(("failed", traceback.format_exc()))
        return
    gm = served.engine.gm
    freeze_startup()
    clock = collector.clock()
    clock.reset()  # (the pauses of serving, not of start-up's captures)
    info = {"eos": model_eos(gm.module), "generation": sampling_of(gm.module), "context": served.context,
            "vocab": model_vocab(gm.module)}
    peers: List[Worker] = []
    main = Worker(conn, gm, clock, served.tokenizer, peers=peers)
    peers.append(main)
    if getattr(args, "api_servers", 1) > 1:
        info["fronts"] = _listen(gm, clock, served.tokenizer, info, peers)
    conn.send(("ready", info))
    main.serve()


def _listen(gm, clock: GcClock, tokenizer: Any, info: Dict[str, Any], peers: List[Worker]):
    """A local socket for the other HTTP processes (``--api-servers``): ``(address, key)``. Each
    that connects (with the key) gets ``("ready", info)`` and a worker of its own, on a thread."""
    import os
    from multiprocessing.connection import Listener

    key = os.urandom(32)
    listener = Listener(family="AF_UNIX", authkey=key)

    def accept():
        while True:
            try:
                conn = listener.accept()
            except OSError:  # (closed)
                return
            except Exception:  # noqa: BLE001 - a stranger without the key: refused, the others served
                logger.warning("a connection to the engine was refused", exc_info=True)
                continue
            conn.send(("ready", info))
            worker = Worker(conn, gm, clock, tokenizer, main=False, peers=peers)
            peers.append(worker)
            threading.Thread(target=worker.serve, name="graphwrap-engine-front", daemon=True).start()

    threading.Thread(target=accept, name="graphwrap-engine-accept", daemon=True).start()
    return listener.address, key
