"""The shared decode batch of one model: its callers' side and the thread that serves them.

Calls queue their sequences (:meth:`DecodeServer.prepare`, then :meth:`DecodeServer.enqueue`); the
decode thread turns (:mod:`.loop`): it schedules (queued sequences take free rows and the blocks
of the cache they need where it is paged, :mod:`.schedule`), runs (the admitted prompts'
forwards, a long prompt's piece, one step over every live row, each given its next block first:
where none is free the sequence admitted last is preempted and recomputed later, see
:mod:`.scheduler`) and processes outputs (:mod:`.outputs`). The cache is made by
:func:`make_cache` (its size and layout: :mod:`.pool`). Steps are queued ahead: the tokens of a
step are read on the host (through pinned memory and an event) after the next step has been
launched, so the GPU never waits for the host's bookkeeping. A sequence found finished (an
end-of-sequence token) has its row given back one step late; the token the extra step made for
it is dropped.

Each sequence's record is its :class:`~.scheduler.Seq` (ids, settings, row, blocks, tokens, where
it stands), pointing to its call's (:class:`~..callers.calls.Call`: the future, the mailbox and
sink its tokens and end are delivered through). A call ends in one place
(:meth:`DecodeServer.end_call`, on the decode thread): its sequences are marked done (their rows
are given back, settings and all, at the next retire) and its streamer's end and its result are
handed to it by a delivery worker (:mod:`.delivery`): no caller's code runs on the decode thread.
A cancel, a streamer that raises and a closed batch reach the decode thread as calls to end
(``self.cancelled``), under the lock.

Lock rules: ``self.lock`` (``self.cond``) guards the scheduler's queue and rows, ``cancelled``,
``closed``, ``stopping`` and ``thread``; the decode thread takes it only to admit and retire,
never while a step runs, and nothing holds it while waiting on the GPU or running a caller's
code. A caller waits on ``self.cond`` for room in the queue; whatever ends the batch notifies it.
"""

import atexit
import collections
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Counter, DefaultDict, Deque, Dict, List, Optional, Tuple

import torch

from ...capture.cuda import stream_after, use_device
from ...core.engine import Engine
from ...errors import GraphwrapError
from ..cache import fp8
from ..cache.pages import PagedStore
from ..cache.pool import CACHE_MEMORY, PIECE, PIECE_ALONE, Blocks, Prefixes, plan_cache
from ..cache.rows import RowStore
from ..callers.calls import Call, Sinks, check_call, finish
from ..callers.delivery import OUTBOX, Mailbox, on_worker
from ..callers.errors import Closed, QueueFull
from ..callers.settings import CallPlan, in_vocab, out_vocab
from ..kernels import paged_attention
from ..kernels.attention import folding, sdpa_model, without_cudnn
from . import captures, loop
from .captures import Captures, on_stream
from .grammar import matchers
from .inflight import Tokens
from .report import Turns, report
from .sampling import Active, RowSettings
from .scheduler import Scheduler, Seq, buckets_upto
from .shapes import Shapes
from .step import CHUNK, ChunkStep, Prompts, WholeStep, cache_layout, kv_scales, layer_windows
from .weights import Weights

logger = logging.getLogger("graphwrap")
_RUNNING: "weakref.WeakSet" = weakref.WeakSet()  # servers whose thread runs: closed at exit


@atexit.register
def _close_at_exit():
    # The thread must not be inside torch while the interpreter tears torch down (the process
    # then aborts): every batch stops after the step it is in, its calls failing with the
    # reason, and the threads are waited for together.
    servers = list(_RUNNING)
    for server in servers:
        server.stop(GraphwrapError("the process is exiting: this generate call was stopped unfinished"))
    deadline = time.monotonic() + EXIT_WAIT
    for server in servers:
        for thread in (server.thread, server.captures.thread if server.captures is not None else None):
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
    OUTBOX.wait_idle(max(0.0, deadline - time.monotonic()))  # (the calls' ends delivered, and let go)


KEEP = 10_000  # latencies kept for the percentiles in stats()
EXIT_WAIT = 5.0  # seconds the process waits at exit for every decode thread to stop
LET_GO_WAIT = 60.0  # seconds an ended batch waits for its capturing thread before it gives its memory back


class DecodeServer:
    """Continuous batching for one Hugging Face model (see :meth:`GraphedModule.generate`)."""

    budget: Optional[int] = None  # positions a turn's prompt pieces may take (decode={"prefill_budget"}; None: pieces.BUDGET)
    whole_limit: Optional[int] = None  # a long prompt alone prefilled in one forward up to (decode={"prefill_whole"}; None: pieces.WHOLE)
    beside: Optional[int] = None  # prompt tokens a turn admits while rows decode (decode={"prefill_beside"}; None: schedule.PREFILL_BESIDE)

    def __init__(self, model, step_engine, prefill_engine, rows: int, max_len: int, max_queue: int,
                 positions: Optional[int] = None, cache_memory: float = CACHE_MEMORY, paged: Optional[bool] = None,
                 piece_engine=None, mixed_engine=None, compiled: Optional[Dict[str, Engine]] = None,
                 prefix_caching: bool = True, kv_dtype: Optional[str] = None):
        self.model, self.engine, self.prefill_engine = model, step_engine, prefill_engine
        self.piece_engine = piece_engine  # a long prompt's pieces, in the paged pool (see pieces.py)
        p = next(model.parameters())
        self.device = p.device
        self.rows, self.max_len, self.max_queue, self.positions = rows, max_len, max_queue, positions
        self.cache, self.store, self.fold = make_cache(model, rows, max_len, self.device, cache_memory, paged, kv_dtype)
        self.sched = Scheduler(rows, max_len, buckets_upto(rows, (1, 2, 4, 8, 16)), buckets_upto(max_len, (64, 128, 256)),
                               Blocks(self.cache.blocks, self.cache.scratch, Prefixes(self.cache.block) if prefix_caching
                                      else None) if self.cache.paged else None, self.cache.block, CHUNK)
        self.vocab = in_vocab(model)
        self.settings = RowSettings(rows, max_len, self.device, out_vocab(model))
        self.chunk, self.piece, self.piece_alone = CHUNK, min(PIECE, CHUNK, max_len), min(PIECE_ALONE, CHUNK, max_len)
        self.pieces_running: Deque[torch.cuda.Event] = collections.deque()  # the pieces on the device (pieces.py)
        self.prompts = Prompts(rows, min(max_len, self.chunk), self.store.scratch)
        # A piece and the step in one forward (steps.py): where the pool is read in place.
        self.mixed_engine = mixed_engine if piece_engine is not None and getattr(self.store, "kernel", False) else None
        self.chunker, self.whole = ChunkStep(model), WholeStep(model)  # (a long prompt's piece; one in one forward)
        self.next_ids = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        self.weights = Weights(model)
        self.prefixes_stale = False  # (set by a caller that saw the weights' values change: the cache is dropped)
        self.lock = threading.RLock()  # a cancel under it calls back into it
        self.cond = threading.Condition(self.lock)
        self.closed = False
        self.stopping: Optional[BaseException] = None  # set by stop(): every call ends with it
        self.broken: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None
        self.cancelled: List[Call] = []
        self.outgoing: List[tuple] = []  # (mailbox, delivery) of this turn, handed out at its end (flush)
        self.delivered = threading.Condition(threading.Lock())  # guards ``ending``: calls ended, result not yet delivered
        self.ending = 0
        self.inflight = Tokens(rows, self.device)
        self.active = Active()
        self.counts: Counter[str] = collections.Counter()
        self.spent: DefaultDict[str, float] = collections.defaultdict(float)  # seconds of the thread's turns, by part
        self.ttft: Deque[float] = collections.deque(maxlen=KEEP)
        self.tpot: Deque[float] = collections.deque(maxlen=KEEP)
        self.turns = Turns(KEEP)  # the working turns' seconds (a stall shows here; the collector's pauses too)
        self.lag: Deque[float] = collections.deque(maxlen=KEEP)  # a token's made-to-streamer seconds
        self.sinks = Sinks(self.lag, _weak_abort(self))  # (a bound method would make the batch a cycle)
        self.waits: Deque[float] = collections.deque(maxlen=KEEP)
        self.stream = stream_after(self.device)  # (the cache was zeroed on this one: the thread's writes come after)
        self.shapes = Shapes(self.stream is not None)
        self.twins: Dict[tuple, PagedStore] = {}  # shape -> the twin of the cache its graph was captured over
        # compile=: the engines whose compiled graphs replace plain ones, by kind ("step", "prefill",
        # "piece", "mixed"), and shape -> (engine, twin) of each compiled graph that serves (captures.py)
        self.compiled_engines: Dict[str, Engine] = dict(compiled or {})
        self.compiled: Dict[tuple, Tuple[Engine, PagedStore]] = {}
        self.captures: Optional[Captures] = None
        if self.stream is not None and isinstance(self.store, PagedStore):
            self.start_captures()
        elif self.compiled_engines and not isinstance(self.store, PagedStore):  # (the decode thread captures: compiled from the first)
            c = self.compiled_engines
            self.engine, self.prefill_engine = c["step"], c["prefill"]
            self.piece_engine = c["piece"] if self.piece_engine is not None else None
            self.mixed_engine = c.get("mixed") if self.mixed_engine is not None else None
            self.compiled_engines = {}

    def start_captures(self):
        """Capture new shapes on a thread of their own from now on (see :mod:`.captures`)."""
        self.captures, self.shapes = captures.start(self)

    # ------------------------------------------------------------------ callers

    def prepare(self, plan: CallPlan, seed: Optional[int] = None) -> Call:
        """A call of ``plan``, its sampling seeds drawn (in the caller's thread, once, from
        torch's default generator, or from ``seed`` where one is given: ``torch.manual_seed``
        before a call makes it repeat); GraphwrapError where the batch cannot hold it."""
        self.check(plan)
        fut: Future = Future()
        abort = _weak_abort(self)  # (a call outlives its batch's thread in its caller's hands)
        call = Call(plan, fut, Mailbox(lambda e: abort(call, e)))
        n = len(plan.prompts)
        g = None if seed is None else torch.Generator().manual_seed(seed)
        seeds = torch.randint(0, 1 << 31, (n,), generator=g).tolist() if plan.settings.sample else [0] * n
        call.seqs = [Seq(call, i, p, plan.settings, seed=seed) for i, (p, seed) in enumerate(zip(plan.prompts, seeds))]
        if plan.settings.grammar is not None:
            matchers(call.seqs, plan.settings.grammar, self.settings.eos_of(plan.settings))
        call.left = len(call.seqs)
        fut.add_done_callback(lambda f: abort(call, None) if f.cancelled() else None)
        return call

    def enqueue(self, call: Call, block: bool = True):
        """Queue a prepared call, waiting for room (``block``) or raising QueueFull; a call
        cancelled meanwhile is not queued. Closed where the batch was closed."""
        n = len(call.seqs)
        with self.cond:
            while not self.closed and len(self.sched.queue) + n > self.max_queue and self.sched.queue:
                if call.future.cancelled():
                    return
                if not block:
                    raise QueueFull(f"the decode queue is full ({len(self.sched.queue)} sequences waiting, "
                                    f"max_queue={self.max_queue}): try again later")
                self.cond.wait()
            if self.closed:
                raise Closed("this GraphedModule's decode batch is closed: it takes no new generate calls")
            if call.future.cancelled():
                return
            streamer = call.plan.streamer
            if streamer is not None:  # the prompt first, as generate's streamer gets it
                OUTBOX.post(call.box, lambda: streamer.put(call.plan.input_ids))
            self.sched.enqueue(call.seqs)
            call.queued = True
            if self.captures is not None:
                self.captures.calls(+1)
            self.counts["calls"] += 1
            self.counts["sequences"] += n
            if self.thread is None:
                self.thread = threading.Thread(target=_decode_thread, args=(self,), name="graphwrap-decode", daemon=True)
                self.thread.start()
                _RUNNING.add(self)
            self.cond.notify_all()

    def abort(self, call: Call, error: Optional[BaseException]):
        """End ``call`` at the next turn of the decode thread (cancelled where ``error`` is
        None, else failed with it): from any thread."""
        with self.cond:
            if error is not None and call.error is None:
                call.error = error
            self.cancelled.append(call)
            self.cond.notify_all()

    def check(self, plan: CallPlan):
        """GraphwrapError for a call the cache cannot hold or token ids the model has no row for."""
        check_call(plan, self.max_len, self.positions, self.cache, self.vocab, self.settings.vocab)

    def all_seqs(self):
        yield from self.sched.queue
        yield from (s for s in self.sched.holders if s is not None)
        for f in self.inflight.queued:
            yield from f.seqs

    def close(self, cancel: bool = False, timeout: Optional[float] = None) -> bool:
        """Take no new calls; finish what is queued and running (``cancel=True``: cancel what
        has not started). Whether the thread ended, and every call's result was delivered,
        within ``timeout``."""
        with self.cond:
            self.closed = True
            queued = [s.call.future for s in self.sched.queue] if cancel else []
            self.cond.notify_all()
            thread = self.thread
        if self.captures is not None:
            self.captures.stop(timeout)
        for fut in queued:  # (outside the lock: a future's callbacks run the caller's code)
            fut.cancel()
        deadline = None if timeout is None else time.monotonic() + timeout
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return False
        if on_worker():
            return True  # called from a caller's callback or streamer: its own delivery is under way
        with self.delivered:  # each ended call's last delivery (its result) made
            while self.ending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.delivered.wait(left)
        return True

    def stop(self, error: BaseException):
        """End every call now with ``error`` (after the step in flight) and take no new ones."""
        with self.cond:
            self.closed = True
            self.stopping = error
            self.cond.notify_all()
        if self.captures is not None:
            self.captures.stop(0)

    def stale(self) -> bool:
        """Whether the model's weights moved, or changed dtype or device, since the batch was
        made (``model.half()``, ``model.to(...)``): its cache no longer fits the model. With an
        FP8 cache, also where their values changed in place: its scales came from the old."""
        if self.weights.changed():
            return True
        return getattr(self.store, "scales", None) is not None and self.weights.values_since_made()

    # ------------------------------------------------------------------ the thread

    def _run(self):
        try:
            with on_stream(self.stream), torch.no_grad():
                while loop.turn(self):
                    self.flush()
                self.flush()
        except BaseException as e:  # noqa: BLE001 - every call waiting must end, with this error
            logger.exception("the decode thread failed; every call it held fails with the error")
            with self.cond:
                self.closed = True
                self.broken = e
                calls = {s.call for s in self.all_seqs()}
                self.sched.queue.clear()
                self.cond.notify_all()  # callers waiting for room find the batch closed
            for call in calls:
                self.end_call(call, e)
            self.flush()

    def flush(self):
        """Hand the turn's tokens to their sinks, then its deliveries (tokens, ends) to the
        workers, in one go."""
        self.sinks.flush()
        if self.outgoing:
            OUTBOX.post_many(self.outgoing)
            self.outgoing = []

    def end_call(self, call: Call, error: Optional[BaseException]):
        """The one place a call ends: its sequences stop (their rows are given back at the next
        retire), and its streamer's end and its result or error are delivered off this thread."""
        if call.ended:
            return
        call.ended = True
        if call.queued and self.captures is not None:
            self.captures.calls(-1)
        for s in call.seqs:
            s.done = True
        if error is not None and call.error is None:
            call.error = error
        with self.delivered:
            self.ending += 1
        self.outgoing.append((call.box, lambda: self._finish(call)))

    def _finish(self, call: Call):
        # call.error read now: a streamer that raised on a token delivered before this one
        # (after the decode thread ended the call) fails the call all the same.
        if self.captures is not None:
            self.captures.settle()
        try:
            finish(call, call.error)
        finally:
            with self.delivered:
                self.counts["cancelled" if call.future.cancelled() else
                            "failed" if call.error is not None else "done"] += 1
                self.ending -= 1
                self.delivered.notify_all()

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        return report(self)


def _weak_abort(server: DecodeServer):
    """``server.abort`` without a reference to the batch: a no-op once the batch is gone."""
    ref = weakref.ref(server)

    def abort(call: Call, error: Optional[BaseException]):
        s = ref()
        if s is not None:
            s.abort(call, error)
    return abort


def _decode_thread(server: DecodeServer):
    try:
        use_device(server.device)  # (a model on another GPU than the process's current one)
        server._run()
    finally:
        let_go(server)


def let_go(server: DecodeServer):
    """At the decode thread's end (closed, stopped or broken): the capturing thread is waited
    for, then the cache's pools, every engine's graphs and the sampler's are given back, and the capturer's
    reference to the batch dropped (a cycle), so that its memory returns
    when the thread ends, not when the garbage collector next finds the batch (a dropped
    GraphedModule's, say: on a GPU the pool is most of the device)."""
    if server.stopping is not None:  # (the process is exiting: torch may be torn down under a reset)
        return
    if server.captures is not None:
        if not server.captures.stop(LET_GO_WAIT):  # (a capture under way still reads the cache: left to the collector)
            logger.warning("the shared batch's capturing thread did not stop in %.0f s: its memory goes when the "
                           "batch is collected", LET_GO_WAIT)
            return
        server.captures.server = None  # (its thread has ended)
    try:
        server.twins.clear()
        server.compiled.clear()
        for engine in {id(e): e for e in (server.engine, server.prefill_engine, server.piece_engine,
                                          server.mixed_engine, *server.compiled_engines.values()) if e is not None}.values():
            engine.reset()
        if server.settings.graphs is not None:  # (the sampler's graphs and their pool)
            server.settings.graphs.reset()
    except Exception:  # noqa: BLE001 - (after a CUDA error, say): what is left goes with the batch
        logger.exception("the shared batch's graphs could not all be given back at its end")
    server.store.free()


def make_cache(model, rows: int, max_len: int, device: torch.device, cache_memory: float, paged: Optional[bool],
               kv_cache_dtype: Optional[str] = None):
    """``(plan, store, fold)``: the cache's layout and size (:mod:`.pool`), its tensors, and the
    attention the steps run in (grouped key heads folded; a paged pool read in place). With
    ``kv_cache_dtype="fp8"``, the pool is paged and FP8, its scales from a calibration forward
    (:mod:`..cache.fp8`)."""
    scales = None
    with without_cudnn(device):
        keys, values = cache_layout(model, device)
        if fp8.wanted(kv_cache_dtype):
            scales = kv_scales(model, device, min(fp8.CALIBRATION, max_len))
    in_place = reads_in_place(model, device, kv_cache_dtype)
    token_bytes = _token_bytes(keys, values, kv_cache_dtype)
    plan = plan_cache(rows, max_len, token_bytes, _free_memory(device), cache_memory,
                      True if scales is not None else paged, in_place)
    logger.info("decode cache of %s: %s%s", type(model).__name__, plan.why, _scales_line(scales, in_place))
    store = PagedStore(rows, max_len, device, plan.block, plan.blocks, kernel=in_place) if plan.paged \
        else RowStore(rows, max_len, device)
    fold = folding(model, store)
    if isinstance(store, PagedStore):
        store.kernel = fold.store is not None
        store.layer_windows = layer_windows(model)
        store.scales = scales
    store.allocate(keys, values)
    return plan, store, fold


def _scales_line(scales, in_place: bool) -> str:
    if scales is None:
        return ""
    d = fp8.describe(scales) or {}
    (k0, k1), (v0, v1) = d["key_scale"], d["value_scale"]
    return (f"; keys and values in FP8 E4M3, scales per layer from a calibration forward (keys {k0:.3g}-"
            f"{k1:.3g}, values {v0:.3g}-{v1:.3g}), "
            + ("read in place" if in_place else "gathered and read back before the model's attention"))


def reads_in_place(model, device: torch.device, kv_cache_dtype: Optional[str] = None) -> bool:
    """Whether a step of ``model`` can read the paged pool in place: the Triton kernel, on CUDA,
    where the model's attention is transformers' sdpa and its weights are of a dtype the kernel
    serves (fp16, bf16, fp32; elsewhere, ``model.double()`` say, each row's blocks are gathered),
    and, for an FP8 pool, the GPU's kernels read E4M3 (compute capability 8.9 on)."""
    p = next(model.parameters(), None)
    served = p is None or p.dtype in (torch.float16, torch.bfloat16, torch.float32)
    fp8_read = not fp8.wanted(kv_cache_dtype) or fp8.kernels_read(device)
    return paged_attention.available() and device.type == "cuda" and sdpa_model(model) and served and fp8_read


def _token_bytes(keys, values, kv_cache_dtype: Optional[str] = None) -> int:
    """Bytes of one position's keys and values over every layer (from ``[batch, heads, len, dim]``;
    one a value where the pool is FP8)."""
    size = (lambda t: 1) if fp8.wanted(kv_cache_dtype) else (lambda t: t.element_size())
    return sum(t.shape[1] * t.shape[3] * size(t) for t in list(keys) + list(values))


def _free_memory(device: torch.device) -> Optional[int]:
    """Bytes of the device's memory free now (with what torch's allocator holds unused), None on a CPU."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + reserved)
