"""The thread that serves every ``generate`` call of a model from one shared decode batch.

Calls queue their sequences (:meth:`DecodeServer.submit` returns a future); the thread admits
queued sequences into free rows (one joined prompt forward), runs one decode step over every
live row, and hands each call its tokens when its last sequence ends. Steps are queued ahead:
the tokens of a step are read on the host (through pinned memory and an event) after the next
step has been launched, so the GPU never waits for the host's bookkeeping. A sequence found
finished (an end-of-sequence token) has its row given back one step late; the token the extra
step made for it is dropped.
"""

import atexit
import collections
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Counter, DefaultDict, Deque, List, Optional, Set, cast

import torch

from ..errors import GraphwrapError
from .attention import folding
from .rows import RowStore, to_device
from .sampling import Active, RowSettings
from .scheduler import Scheduler, Seq, buckets_upto
from .settings import CallPlan
from .step import Prompts, cache_layout

logger = logging.getLogger("graphwrap")
_RUNNING: "weakref.WeakSet" = weakref.WeakSet()  # servers whose thread runs: closed at exit


@atexit.register
def _close_at_exit():
    # The thread must not be inside torch while the interpreter tears torch down (the process
    # then aborts): each batch finishes what it holds and its thread ends first.
    for server in list(_RUNNING):
        server.close(cancel=True, timeout=10.0)


KEEP = 10_000  # latencies kept for the percentiles in stats()
AHEAD = 2  # steps queued on the device before the host reads the oldest
CAPTURE_AFTER = 16  # steps a shape is wanted, served by a larger captured one, before it is captured


class QueueFull(GraphwrapError):
    """The decode queue holds ``max_queue`` sequences (raised where the caller would not wait)."""


@dataclass(eq=False)
class Call:
    """One ``generate`` call: its future, its sequences and what its result is built from."""

    plan: CallPlan
    future: Future
    seqs: List[Seq] = field(default_factory=list)
    left: int = 0
    error: Optional[BaseException] = None


@dataclass(eq=False)
class InFlight:
    """Tokens queued on the device and not yet read: which sequence each row's token is for."""

    seqs: List[Seq]
    rows: List[int]
    host: torch.Tensor
    event: Optional[torch.cuda.Event]
    buf: Optional[torch.Tensor] = None  # the pinned buffer ``host`` is a view of


def _rows(seqs: List[Seq]) -> List[int]:
    """The rows of sequences that hold one (every sequence admitted)."""
    return cast(List[int], [s.row for s in seqs])


class DecodeServer:
    """Continuous batching for one Hugging Face model (see :meth:`GraphedModule.generate`)."""

    def __init__(self, model, step_engine, prefill_engine, rows: int, max_len: int, max_queue: int):
        self.model, self.engine, self.prefill_engine = model, step_engine, prefill_engine
        p = next(model.parameters())
        self.device = p.device
        self.rows, self.max_len, self.max_queue = rows, max_len, max_queue
        self.sched = Scheduler(rows, max_len, buckets_upto(rows, (1, 2, 4, 8, 16)),
                               buckets_upto(max_len, (64, 128, 256)))
        self.store = RowStore(rows, max_len, self.device)
        keys, values = cache_layout(model, self.device)
        self.store.allocate(keys, values)
        self.settings = RowSettings(rows, max_len, self.device)
        self.prompts = Prompts(rows, max_len, self.store.scratch)
        self.next_ids = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        self.vocab = _vocab(model)
        self.lock = threading.RLock()  # a cancel under it calls back into it
        self.cond = threading.Condition(self.lock)
        self.closed = False
        self.broken: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None
        self.cancelled: List[Call] = []
        self.inflight: Deque[InFlight] = collections.deque()
        self.spare: List[tuple] = []  # (pinned buffer, event) pairs read and free again
        self.active = Active()
        self.counts: Counter[str] = collections.Counter()
        self.spent: DefaultDict[str, float] = collections.defaultdict(float)  # seconds of the thread's turns, by part
        self.ttft: Deque[float] = collections.deque(maxlen=KEEP)
        self.tpot: Deque[float] = collections.deque(maxlen=KEEP)
        self.waits: Deque[float] = collections.deque(maxlen=KEEP)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.shapes = Shapes()
        self.fold = folding(model)  # grouped key heads: the step's attention without repeating them

    # ------------------------------------------------------------------ callers

    def submit(self, plan: CallPlan, block: bool = True) -> Future:
        """Queue a call's sequences; a future of its output tensor (on the input's device)."""
        self.check(plan)
        fut: Future = Future()
        call = Call(plan, fut)
        # Drawn from torch's default generator: torch.manual_seed before a call makes it repeat.
        seeds = torch.randint(0, 1 << 31, (len(plan.prompts),)).tolist() if plan.settings.sample else [0] * len(
            plan.prompts)
        call.seqs = [Seq(call, i, p, plan.settings) for i, p in enumerate(plan.prompts)]
        for s, seed in zip(call.seqs, seeds):
            s.seed = seed
        call.left = len(call.seqs)
        if plan.streamer is not None:
            plan.streamer.put(plan.input_ids.cpu())
        with self.cond:
            while not self.closed and len(self.sched.queue) + len(call.seqs) > self.max_queue and self.sched.queue:
                if not block:
                    raise QueueFull(f"the decode queue is full ({len(self.sched.queue)} sequences waiting, "
                                         f"max_queue={self.max_queue}): try again later")
                self.cond.wait()
            if self.closed:
                raise GraphwrapError("this GraphedModule's decode batch is closed: it takes no new generate calls")
            self.sched.enqueue(call.seqs)
            self.counts["calls"] += 1
            self.counts["sequences"] += len(call.seqs)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="graphwrap-decode", daemon=True)
                self.thread.start()
                _RUNNING.add(self)
            self.cond.notify_all()
        fut.add_done_callback(self._on_done)
        return fut

    def check(self, plan: CallPlan):
        """GraphwrapError for a call the cache cannot hold or token ids the model has no row for."""
        need = max(len(p) for p in plan.prompts) + plan.settings.max_new
        if need > self.max_len:
            raise GraphwrapError(
                f"a prompt of {max(len(p) for p in plan.prompts)} tokens and max_new_tokens="
                f"{plan.settings.max_new} need {need} positions of the decode cache, which holds {self.max_len} per "
                f"sequence: pass fewer tokens, or GraphedModule(..., decode={{'max_len': {need}}})")
        bad = [t for p in plan.prompts for t in p if not 0 <= t < self.vocab]
        if bad:
            raise GraphwrapError(f"token id {bad[0]} is outside the model's vocabulary of {self.vocab}")

    def _on_done(self, fut: Future):
        if fut.cancelled():
            with self.cond:
                call = next((s.call for s in self._all_seqs() if s.call.future is fut), None)
                if call is not None:
                    self.cancelled.append(call)
                    self.cond.notify_all()

    def _all_seqs(self):
        yield from self.sched.queue
        yield from (s for s in self.sched.holders if s is not None)
        for f in self.inflight:
            yield from f.seqs

    def close(self, cancel: bool = False, timeout: Optional[float] = None) -> bool:
        """Take no new calls; finish what is queued and running (``cancel=True``: cancel what
        has not started). Whether the thread ended within ``timeout``."""
        with self.cond:
            self.closed = True
            if cancel:
                for s in self.sched.drop_queued(lambda s: True):
                    s.done = True
                    s.call.future.cancel()
            self.cond.notify_all()
            thread = self.thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    # ------------------------------------------------------------------ the thread

    def _run(self):
        try:
            with _on(self.stream), torch.no_grad():
                while self._turn():
                    pass
        except BaseException as e:  # noqa: BLE001 - every call waiting must end, with this error
            logger.exception("graphwrap: the decode thread failed; every call it held fails with the error")
            with self.cond:
                self.closed = True
                self.broken = e
                seqs = list(self._all_seqs())
                self.sched.queue.clear()
            for s in seqs:
                self._fail(s, e)

    def _turn(self) -> bool:
        """One round: admit, step, read; False once closed and nothing is left."""
        with self.cond:
            self._take_cancelled()
            admitted = self.sched.admit()
            if admitted:
                self.cond.notify_all()  # room in the queue
                now = time.perf_counter()
                self.waits.extend(now - s.submitted for s in admitted)
            elif not self.inflight and not self.sched.live():
                if self.closed and not self.sched.queue:
                    return False
                self.cond.wait()
                return True
        clock = time.perf_counter
        t0 = clock()
        if admitted:
            self._admit(admitted)
        t1 = clock()
        live = self.sched.live()
        if live:
            self._step(live)
        t2 = clock()
        self._read(keep=AHEAD if live else 0)
        t3 = clock()
        self._retire()
        spent = self.spent
        spent["prefill"] += t1 - t0
        spent["step"] += t2 - t1
        spent["read"] += t3 - t2
        spent["retire"] += clock() - t3
        return True

    def _take_cancelled(self):
        for call in self.cancelled:
            for s in call.seqs:
                s.done = True
            self.sched.drop_queued(lambda s: s.call is call)
            self.counts["cancelled"] += 1
        self.cancelled.clear()

    def _admit(self, seqs: List[Seq]):
        for group in self.prompts.groups([s.prompt for s in seqs]):
            batch = [seqs[i] for i in group]
            try:
                self._prefill(batch)
            except Exception as e:  # noqa: BLE001 - a prompt that makes the model raise fails alone
                if len(batch) == 1:
                    self._fail(batch[0], e)
                    continue
                for s in batch:
                    try:
                        self._prefill([s])
                    except Exception as e1:  # noqa: BLE001
                        self._fail(s, e1)

    def _prefill(self, seqs: List[Seq]):
        rows = _rows(seqs)
        prompts = [s.prompt for s in seqs]
        shape = self.shapes.pick(("prefill",) + self.prompts.shape(prompts), self.stream is not None)
        inputs = self.prompts.inputs(prompts, rows, shape[1:], self.device)
        logits = self.prefill_engine.call(inputs, {"rows": self.store.prompt_window(shape[2])})[:len(seqs)]
        index = self.settings.write(rows, [s.settings for s in seqs], prompts, [s.seed for s in seqs])
        self.active = Active.of([s.settings for s in self.sched.holders if s is not None])
        tokens = self.settings.next_tokens(logits, index, inputs[1][:len(seqs)], self.active)
        self.next_ids[index, 0] = tokens
        self._queue(seqs, list(range(len(seqs))), tokens)
        self.sched.launched(seqs)
        self.counts["prefills"] += 1
        self.counts["prefill_rows"] += len(seqs)

    def _step(self, live: List[Seq]):
        _, n, span = self.shapes.pick(("step",) + self.sched.step_shape(live), self.stream is not None)
        try:
            with self.fold:
                logits = self.engine.call((self.next_ids[:n],), {"rows": self.store.window(span)})
            tokens = self.settings.next_tokens(logits, n, self.store.lengths[:n], self.active)
        except Exception as e:  # noqa: BLE001 - the step serves every live row: each fails with it
            logger.exception("graphwrap: a decode step failed; its %d sequences fail with the error", len(live))
            for s in live:
                self._fail(s, e)
            return
        self.next_ids[:n, 0] = tokens
        self._queue(live, _rows(live), tokens)
        self.sched.launched(live)
        self.sched.advanced(live)
        self.counts["steps"] += 1
        self.counts["step_rows"] += len(live)
        self.counts["step_padded_rows"] += n - len(live)

    def _queue(self, seqs: List[Seq], at: List[int], tokens: torch.Tensor):
        if self.device.type == "cuda":
            # Pinned buffers and events are kept and used again once read (a fresh pinned
            # tensor and event each step cost host time the step does not have).
            buf, event = self.spare.pop() if self.spare else (
                torch.empty(self.rows, dtype=torch.long, pin_memory=True), torch.cuda.Event())
            host = buf[:tokens.shape[0]]
            host.copy_(tokens, non_blocking=True)
            event.record()
        else:
            buf, host, event = None, tokens, None
        self.inflight.append(InFlight(seqs, at, host, event, buf))

    def _read(self, keep: int):
        """Hand out the tokens of every step but the last ``keep`` (and of any already done)."""
        while self.inflight:
            f = self.inflight[0]
            if len(self.inflight) <= keep and (f.event is None or not f.event.query()):
                return
            if f.event is not None:
                t0 = time.perf_counter()
                f.event.synchronize()
                self.spent["read_wait"] += time.perf_counter() - t0
            self.inflight.popleft()
            tokens = f.host.tolist()
            if f.buf is not None:
                self.spare.append((f.buf, f.event))
            now = time.perf_counter()
            for s, at in zip(f.seqs, f.rows):
                if not s.done:
                    self._token(s, tokens[at], now)

    def _token(self, s: Seq, token: int, now: float):
        s.tokens.append(token)
        if s.first_at is None:
            s.first_at = now
            self.ttft.append(now - s.submitted)
        s.last_at = now
        streamer = s.call.plan.streamer
        if streamer is not None:
            try:
                streamer.put(torch.tensor([token]))
            except Exception as e:  # noqa: BLE001 - a streamer that raises fails its own call
                self._fail(s, e)
                return
        if token in s.settings.eos or len(s.tokens) >= s.settings.max_new:
            s.done = True
            if len(s.tokens) > 1:
                self.tpot.append((s.last_at - s.first_at) / (len(s.tokens) - 1))
            self._seq_ended(s)

    def _fail(self, s: Seq, error: BaseException):
        if s.call.error is None:
            s.call.error = error
        if not s.done:
            s.done = True
            self._seq_ended(s)

    def _seq_ended(self, s: Seq):
        call = s.call
        call.left -= 1
        if call.left > 0:
            return
        for other in call.seqs:
            other.done = True
        streamer = call.plan.streamer
        if streamer is not None and call.error is None:
            try:
                streamer.end()
            except Exception as e:  # noqa: BLE001
                call.error = e
        if call.future.done():
            return
        try:
            if call.error is not None:
                self.counts["failed"] += 1
                call.future.set_exception(call.error)
            else:
                self.counts["done"] += 1
                call.future.set_result(_result(call))
        except Exception:  # noqa: BLE001 - cancelled meanwhile
            pass

    def _retire(self):
        rows = self.sched.retire()
        if rows:
            self.store.release(to_device(torch.tensor(rows, dtype=torch.long), self.device))
            self.active = Active.of([s.settings for s in self.sched.holders if s is not None])
            with self.cond:
                self.cond.notify_all()

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        c = self.counts
        with self.lock:
            queued, busy = len(self.sched.queue), self.sched.busy
        return {
            "rows": self.rows, "max_len": self.max_len, "cache_bytes": self.store.nbytes(),
            "calls": c["calls"], "sequences": c["sequences"], "done": c["done"], "failed": c["failed"],
            "cancelled": c["cancelled"], "queued": queued, "rows_busy": busy,
            "steps": c["steps"], "rows_per_step": c["step_rows"] / c["steps"] if c["steps"] else 0.0,
            "padded_rows_per_step": c["step_padded_rows"] / c["steps"] if c["steps"] else 0.0,
            "in_a_larger_graph": dict(self.shapes.covered), "shapes": sorted(self.shapes.ready),
            "prefills": c["prefills"], "rows_per_prefill": c["prefill_rows"] / c["prefills"] if c["prefills"] else 0.0,
            "queue_wait_ms": _percentiles(self.waits), "ttft_ms": _percentiles(self.ttft),
            "tpot_ms": _percentiles(self.tpot),
            "thread_s": {k: round(v, 3) for k, v in self.spent.items()},
        }


class Shapes:
    """Which graph shape serves a forward: its own buckets once they have a graph, or once they
    have been wanted ``CAPTURE_AFTER`` times (the capture then runs in the decode thread); until
    then the smallest shape of its kind already captured that holds it (more padding rows and
    masked positions, the same tokens), so that a passing shape does not stall every row for a
    capture. Shapes are ``(kind, rows, positions)``."""

    def __init__(self):
        self.ready: Set[tuple] = set()
        self.wanted: Counter[tuple] = collections.Counter()
        self.covered: Counter[tuple] = collections.Counter()

    def pick(self, shape: tuple, graphs: bool) -> tuple:
        if not graphs or shape in self.ready:
            return shape
        self.wanted[shape] += 1
        cover = [s for s in self.ready if s[0] == shape[0] and s[1] >= shape[1] and s[2] >= shape[2]]
        if cover and self.wanted[shape] < CAPTURE_AFTER:
            self.covered[shape[0]] += 1
            return min(cover, key=lambda s: s[1] * s[2])
        self.ready.add(shape)
        del self.wanted[shape]
        return shape


def _result(call: Call) -> torch.Tensor:
    """``generate``'s output: the input as given, then each row's tokens, padded at the end."""
    width = max(len(s.tokens) for s in call.seqs)
    pad = call.plan.settings.pad
    rows = []
    for s in sorted(call.seqs, key=lambda s: s.index):
        rows.append(s.tokens + [pad if pad is not None else 0] * (width - len(s.tokens)))
    new = torch.tensor(rows, dtype=torch.long)
    return torch.cat([call.plan.input_ids.cpu().long(), new], dim=1)


def _percentiles(xs) -> dict:
    if not xs:
        return {"p50": None, "p99": None}
    xs = sorted(xs)
    return {"p50": 1e3 * xs[len(xs) // 2], "p99": 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))]}


def _vocab(model) -> int:
    emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    n = getattr(emb, "num_embeddings", None)
    return int(n if n is not None else model.config.vocab_size)


class _on:
    """``torch.cuda.stream(s)`` for a stream, nothing for None."""

    def __init__(self, stream):
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
