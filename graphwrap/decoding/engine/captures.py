"""The shared batch's graphs, captured on a thread of their own while the decode thread serves.

A step or prompt shape the batch has no graph for is served at once, by a larger captured
graph or eagerly (:mod:`.shapes`), and its capture is queued here. This thread captures each
queued shape through the batch's engines (warm-up, capture, the check against eager), over a
*twin* of the paged cache (:meth:`.pages.PagedStore.twin`): the same pools, metadata of its
own, pointed at blocks no sequence holds, so the capture's runs touch no row of the batch. The
shape is reported to the decode thread once its graph serves (and every run of it has ended on
the device); from then on each of its replays has the cache's metadata copied in and back.

The order: first the shapes a forward asked for that no captured graph holds (they run eagerly
meanwhile, which costs many replays' time, the more so beside a capture, which takes turns with
the decode thread for the interpreter); then the shapes queued ahead (when the batch was made,
where one window serves every step: the largest row bucket's, which holds every step, and a
long prompt's pieces; or by ``gm.capture_generate``); last the shapes a larger graph serves
meanwhile, once wanted often (:mod:`.shapes`), behind a ladder of steps queued when the batch
was made (:func:`ladder`). One capture runs at a time, and only while the batch serves a call (or
``capture_generate`` asked); a capture that fails leaves its shape to larger graphs or to eager
forwards, and says why in the log and in ``stats()``.

With ``compile=``, the graphs above run the plain forward, and each shape's graph of Inductor's
kernels comes after all of them (a queue of its own): compiled while no finished call waits for
it, captured by the kind's compiled engine over a twin of its own while a call is in flight,
then served in place of the plain one (``server.compiled``).
"""

import collections
import logging
import threading
import time
from typing import Deque, List, Optional, Set, Tuple

import torch

from ...capture.cuda import first_line, stream_after, use_device
from ...core.reasons import Eager
from ..kernels.attention import without_cudnn
from .shapes import COVERED, EAGER, GRAPH, NEEDED, Shapes

logger = logging.getLogger("graphwrap")
AHEAD = 1  # the queues, first to last: NEEDED (0), AHEAD, COVERED (2), LATER
LATER = 3  # compile=: a shape's compiled graph, to replace its plain one
PROGRESS_EVERY = 5.0  # seconds between the log's lines of progress while captures are waited for (finish)
COMPILE = "compile"  # a job of LATER: (COMPILE, shape)
LADDER_FROM = 64  # rows of the smallest step of the ladder queued when the batch is made (see ladder)


def start(server):
    """``(captures, shapes)`` of a batch whose new shapes are captured beside its decode thread
    (a paged cache only). Where one window serves every step, the step of the largest row bucket
    is queued now: it holds every step until theirs are captured."""
    caps = Captures(server)
    store = server.store
    span, whole = store.step_span(1), store.step_span(server.max_len)
    if getattr(store, "kernel", False):  # (two windows serve every step: the short rows' first)
        caps.want(("step", server.sched.row_buckets[-1], span), AHEAD)
        for shape in piece_shapes(server):  # (one span each: a process's first long prompt finds them captured)
            caps.want(shape, AHEAD)
        if whole != span:
            caps.want(("step", server.sched.row_buckets[-1], whole), COVERED)
        for n in ladder(server.sched.row_buckets):  # (last: a step not captured yet gets a graph at most twice its rows)
            caps.want(("step", n, span), COVERED)
    return caps, Shapes(True, caps.want)


def ladder(buckets: List[int]) -> List[int]:
    """Of the row buckets below the largest, the powers of two from :data:`LADDER_FROM`: steps
    queued when the batch is made, after every shape queued ahead, so that until a step's own
    graph is captured, one of at most twice its rows serves it, not the largest (a Llama-3-8B
    step of 1,024 rows takes the weights' products of 1,024 rows). On an H200, 32 short
    requests beside the process's first 7,900-token prompt took 2.17x their time alone against
    5.61x, the first run 4.52 s against 4.13; queued with the shapes ahead, 2.09x and 6.50 s
    (``benchmarks/scheduler.py --no-ladder``)."""
    return [n for n in buckets[:-1] if n >= LADDER_FROM and n & (n - 1) == 0]


def piece_shapes(server) -> List[tuple]:
    """The shapes of a long prompt's pieces, beside decoding rows and alone, for each span bucket
    a piece meets (one where the attention reads the pool in place); none where no prompt goes in
    pieces (positions within the chunk and no prefix cached)."""
    store = server.store
    cached = server.sched.pool is not None and server.sched.pool.prefixes is not None
    if server.piece_engine is None or not (server.max_len > server.chunk or cached):  # (a cached prompt's rest: a piece)
        return []
    return [("piece", width, span) for width in sorted({server.piece, server.piece_alone})
            for span in sorted({store.piece_span(b) for b in server.sched.span_buckets if b >= width})]


def every_shape(server, timeout: Optional[float] = None, first: bool = False) -> bool:
    """Queue every shape the batch's buckets make (:func:`shapes_of`; ``first``: those a first
    burst meets, :func:`first_shapes`) and wait for the queue to empty; whether it did within
    ``timeout``. Nothing to do where shapes are captured in the decode thread."""
    caps = server.captures
    if caps is None:
        return True
    for shape in (first_shapes(server) if first else shapes_of(server)):
        caps.want(shape, AHEAD)
    return caps.finish(timeout)


def shapes_of(server) -> List[tuple]:
    """Every shape the batch's buckets make: each step's row and span buckets, each prompt
    forward's row and width buckets, a long prompt's pieces, and a piece beside each step's rows."""
    store = server.store
    spans = sorted({store.step_span(s) for s in server.sched.span_buckets})
    shapes = [("step", n, span) for span in spans for n in server.sched.row_buckets]
    shapes += [("prefill", k, width) for k in server.prompts.row_buckets for width in server.prompts.width_buckets]
    shapes += piece_shapes(server)
    if server.mixed_engine is not None:  # (a piece beside decoding rows inside their step)
        shapes += [("mixed", n, server.piece) for n in server.sched.row_buckets]
    return shapes


def first_shapes(server) -> List[tuple]:
    """Of :func:`shapes_of`, those a server's first burst meets, captured before it answers
    (``python -m graphwrap serve``): the largest of each kind and span, which holds every other
    (padding rows and masked positions), the steps of the :func:`ladder` (a step of few rows
    served by one of at most twice them, or 64), a prompt of one row and of the most rows at each
    width, and a long prompt's pieces. The others are captured as requests need them, beside the
    decode thread (a shape a larger graph holds, once it has been wanted 16 times)."""
    top, steps = server.sched.row_buckets[-1], set(ladder(server.sched.row_buckets))
    every = shapes_of(server)
    short = min(s[2] for s in every if s[0] == "step")  # (the span most steps read)
    rows = server.prompts.row_buckets
    return [s for s in every
            if s[1] == top and s[0] in ("step", "mixed")
            or s[0] == "piece"
            or s[0] in ("step", "mixed") and s[1] in steps and (s[0] == "mixed" or s[2] == short)
            or s[0] == "prefill" and s[1] in (rows[0], rows[-1])]


def forward(server, engine, shape: tuple, how: str, args: tuple, window):
    """One forward of ``shape`` (``window(store)``: the cache it sees): by the graph captured
    over the shape's twin (the cache's lengths, live flags and table copied in, and what it
    wrote of them back), eagerly, or through the engine (which captures a new shape there and
    then)."""
    with server.fold:
        if how == GRAPH:
            done = server.compiled.get(shape)  # (compile=: its compiled graph, once it serves)
            engine, twin = done if done is not None else (engine, server.twins[shape])
            server.store.load(twin)
            out = engine.call(args, {"rows": window(twin)})
            server.store.save(twin)
            return out
        with without_cudnn(server.device):
            if how == EAGER:
                return engine.module(*args, rows=window(server.store))
            return engine.call(args, {"rows": window(server.store)})


def progress(done: int, total: int, seconds: float) -> str:
    """A log line of captures under way: how many of how many, and about how long is left (at
    the pace so far)."""
    if not done:
        return f"capturing the shared batch's graphs: 0 of {total} shapes in {seconds:.0f} s"
    left = seconds / done * (total - done)
    return (f"capturing the shared batch's graphs: {done} of {total} shapes in {seconds:.0f} s, "
            f"about {left:.0f} s left")


class Captures:
    """The capturing thread of one shared batch (started on the first shape queued)."""

    def __init__(self, server):
        self.server = server
        self.cond = threading.Condition(threading.Lock())
        self.queues: List[Deque[tuple]] = [collections.deque() for _ in (NEEDED, AHEAD, COVERED, LATER)]
        self.seen: Set[tuple] = set()
        self.running: Optional[tuple] = None
        self.stopped = False
        self.thread: Optional[threading.Thread] = None
        self.device: torch.device = server.device
        self.stream = stream_after(server.device)  # (its twins read the cache's tensors, made on this one)
        self.seconds = 0.0
        self.done = 0
        self.serving = 0  # calls of the batch in flight: captures run only while there are some
        self.ahead_of_calls = False  # capture whatever is queued, calls or not (every_shape)
        # The running job compiles, or waits for a call before its capture: no caller waits for it.
        self.apart = False

    def want(self, shape: tuple, queue: int = NEEDED):
        """Queue ``shape``'s capture (once), in ``queue``: :data:`NEEDED`, :data:`AHEAD` or
        :data:`COVERED`; a shape queued already moves to ``queue`` where that comes first (a shape
        queued when the batch was made, then needed by a forward before its turn)."""
        with self.cond:
            if self.stopped:
                return
            if shape in self.seen:  # (queued ahead, and now needed: its place moves up)
                later = next((q for q in self.queues[queue + 1:] if shape in q), None)
                if later is not None:
                    later.remove(shape)
                    self.queues[queue].append(shape)
                    self.cond.notify_all()
                return
            self.seen.add(shape)
            self.queues[queue].append(shape)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="graphwrap-decode-capture", daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def calls(self, change: int):
        """A call of the batch was queued (+1) or ended (-1)."""
        with self.cond:
            self.serving += change
            self.cond.notify_all()

    def settle(self):
        """Before a call's result is handed over: where no other call is in flight, wait for the
        capture under way to end, so that a caller done with the batch finds no capture running
        (a device-wide ``torch.cuda.synchronize()`` fails while any stream captures)."""
        with self.cond:
            while self.running is not None and not self.apart and self.serving == 0 and not self.ahead_of_calls:
                self.cond.wait()

    def queued(self) -> list:
        with self.cond:
            return [s for q in self.queues for s in q] + ([self.running] if self.running else [])

    def finish(self, timeout: Optional[float] = None) -> bool:
        """Capture what is queued now, calls in flight or not, and wait until nothing is queued or
        being captured; whether that happened within ``timeout``. Every :data:`PROGRESS_EVERY`
        seconds meanwhile, the log says how far it is and about how long is left."""
        t0 = time.monotonic()
        end = None if timeout is None else t0 + timeout
        with self.cond:
            self.ahead_of_calls = bool(any(self.queues) or self.running)
            self.cond.notify_all()
            first, total, said = self.done, self._left(), t0
            while (any(self.queues) or self.running is not None) and not self.stopped:
                now = time.monotonic()
                left = None if end is None else end - now
                if left is not None and left <= 0:
                    return False
                if now - said >= PROGRESS_EVERY:
                    said = now
                    total = max(total, self.done - first + self._left())  # (captures queue compiles after them)
                    logger.info("%s", progress(self.done - first, total, now - t0))
                self.cond.wait(PROGRESS_EVERY if left is None else min(left, PROGRESS_EVERY))
            return not any(self.queues) and self.running is None

    def _left(self) -> int:
        return sum(len(q) for q in self.queues) + (self.running is not None)

    def stop(self, timeout: Optional[float] = None) -> bool:
        """Capture nothing more (a capture under way ends first); whether the thread ended in time."""
        with self.cond:
            self.stopped = True
            for q in self.queues:
                q.clear()
            self.cond.notify_all()
            thread = self.thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _next(self) -> Optional[tuple]:
        with self.cond:
            while not self.stopped and not (any(self.queues) and (self.serving or self.ahead_of_calls)):
                self.cond.wait()
            if self.stopped:
                return None
            self.running = next(q for q in self.queues if q).popleft()
            return self.running

    def _run(self):
        use_device(self.device)  # (the batch's GPU, whichever is the process's current one)
        # Everything this thread makes (twins, inputs) and runs is on its own stream, which the
        # capture's streams wait for: made on the default stream, a tensor could be read before
        # it was written (the likely cause of an embedding's index out of bounds on an H200).
        with on_stream(self.stream):
            self._jobs()

    def _jobs(self):
        while True:
            job = self._next()
            if job is None:
                return
            t0 = time.perf_counter()
            compiled = job[0] == COMPILE
            shape = job[1] if compiled else job
            try:
                why = self._compile(shape) if compiled else self._capture(shape)
            except Exception as e:  # noqa: BLE001 - the shape is served eagerly (or by its plain graph); the batch goes on
                why = f"{type(e).__name__}: {e}"
            self.seconds += time.perf_counter() - t0
            self.done += 1
            self._report(shape, why, compiled, time.perf_counter() - t0)
            with self.cond:
                self.running = None
                self.apart = False
                if why is None and not compiled and shape[0] in self.server.compiled_engines:
                    self.queues[LATER].append((COMPILE, shape))
                if not any(self.queues):
                    self.ahead_of_calls = False
                self.cond.notify_all()

    def _report(self, shape: tuple, why: Optional[str], compiled: bool, seconds: float):
        if compiled:
            if why is not None:
                logger.warning("the shared batch's %s shape %s keeps its plain graph (compile=: %s)",
                               shape[0], shape[1:], why)
            else:
                logger.info("compiled the shared batch's %s shape %s beside the decode thread in %.1f s: its "
                            "replays run Inductor's kernels from now on", shape[0], shape[1:], seconds)
            return
        if why is not None:
            logger.warning("no graph for the shared batch's %s shape %s (%s): it runs in a larger graph or eagerly",
                           shape[0], shape[1:], why)
        else:
            logger.info("captured the shared batch's %s shape %s beside the decode thread in %.0f ms",
                        shape[0], shape[1:], 1e3 * seconds)
        self.server.shapes.captured(shape, why)

    def _inputs(self, shape: tuple, twin) -> Tuple[tuple, dict]:
        """A forward of ``shape`` over ``twin``: its inputs (ids of zeros, the place of a piece)."""
        server = self.server
        kind, n, width = shape
        device = server.device
        if kind == "mixed":  # (n: the step's rows; width: the piece's positions)
            return ((torch.zeros((1, n + width), dtype=torch.long, device=device),
                     torch.tensor([0, width, server.store.scratch], dtype=torch.long, device=device)),
                    {"rows": twin.mixed_window(n, width)})
        if kind == "piece":  # (n: the piece's positions; width: the span it attends over)
            return ((torch.zeros((1, n), dtype=torch.long, device=device),
                     torch.tensor([0, n, 0], dtype=torch.long, device=device)), {"rows": twin.piece_window(n, width)})
        if kind == "step":
            return (torch.zeros((n, 1), dtype=torch.long, device=device),), {"rows": twin.window(width)}
        return ((torch.zeros((n, width), dtype=torch.long, device=device),
                 torch.full((n,), width, dtype=torch.long, device=device),
                 torch.full((n,), server.store.scratch, dtype=torch.long, device=device)),
                {"rows": twin.prompt_window(width)})

    def _twin(self, shape: tuple):
        """A new twin of the cache for a capture of ``shape``."""
        store = self.server.store
        kind, n, width = shape
        return store.mixed_twin(width) if kind == "mixed" else store.piece_twin(n) if kind == "piece" else store.twin()

    def _capture(self, shape: tuple) -> Optional[str]:
        """Capture ``shape`` over a new twin of the cache; None once its graph serves, else why not."""
        server = self.server
        engines = {"mixed": server.mixed_engine, "piece": server.piece_engine, "step": server.engine}
        twin = self._twin(shape)
        why = self._graph(engines.get(shape[0], server.prefill_engine), shape, twin)
        if why is None:
            server.twins[shape] = twin
        return why

    def _graph(self, engine, shape: tuple, twin) -> Optional[str]:
        """``engine``'s graph of ``shape`` over ``twin``, captured and checked; None once it serves
        (its last replay ended), else why not."""
        server = self.server
        args, kwargs = self._inputs(shape, twin)
        with on_stream(self.stream), torch.no_grad(), server.fold, without_cudnn(server.device):
            engine.call(args, kwargs)
            f = engine.facts(args, kwargs)
            why = str(f) if type(f) is Eager else None
            if why is None:
                plan = engine.plan(f)
                if plan.eager:
                    why = str(plan.reason) if plan.reason is not None else "the engine serves it eagerly"
        if self.stream is not None:
            self.stream.synchronize()  # the capture's last replay has ended before the decode thread loads the twin
        return why

    def _compile(self, shape: tuple) -> Optional[str]:
        """compile=: ``shape``'s graph of Inductor's kernels over a new twin, to replace its plain
        one; None once it serves, else why not. Inductor compiles first, while no caller waits
        for it (:meth:`settle`) and calls or none; the capture waits for a call in flight (a
        device-wide synchronize of a caller done with the batch never meets it)."""
        server = self.server
        engine = server.compiled_engines[shape[0]]
        twin = self._twin(shape)
        with self.cond:
            self.apart = True
            self.cond.notify_all()  # (a delivery that began to wait in settle() meanwhile goes on)
        try:
            precompile(engine, self.stream, server, *self._inputs(shape, twin))
        except Exception as e:  # noqa: BLE001 - the capture compiles it then (as where nothing compiled ahead)
            logger.info("compiling the shared batch's %s shape %s ahead of its capture failed (%s: %s); its "
                        "capture compiles it", shape[0], shape[1:], type(e).__name__, first_line(e))
        with self.cond:
            while not self.stopped and not (self.serving or self.ahead_of_calls):
                self.cond.wait()
            if self.stopped:
                return "the batch closed"
            self.apart = False
        why = self._graph(engine, shape, twin)
        if why is None and engine.capturer.compile_off is not None:
            why = f"compile= given up: {engine.capturer.compile_off}"
        if why is None:
            server.compiled[shape] = (engine, twin)
        return why


def precompile(engine, stream, server, args: tuple, kwargs: dict):
    """Run ``engine``'s compiled forward once on a capture's inputs (over a twin: nothing of a
    row is touched), so that Inductor compiles it before the capture, which then finds it
    compiled; nothing where ``compile=`` is given up."""
    from ...capture.work import compiled_forward

    with engine.lock:
        cf = compiled_forward(engine)
    if cf is None:
        return
    graphs, cf.ahead = cf.graphs, None  # (a run that fails hands the capture nothing)
    with on_stream(stream), torch.no_grad(), server.fold, without_cudnn(server.device):
        cf(*args, **kwargs)
    if stream is not None:
        stream.synchronize()
    cf.ahead = cf.graphs - graphs  # (the capture's warm-up finds them compiled: counted as its own)


class on_stream:
    """``torch.cuda.stream(s)`` for a stream, nothing for None."""

    def __init__(self, stream):
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
