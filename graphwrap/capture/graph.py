"""One capture: a bucket's graph from a sample, warmed up, recorded and verified.

:func:`capture_bucket` takes a :class:`Job` (everything a capture needs, passed down) and a
recorder (the device's part: CUDA's in :class:`CudaRecorder`; a stand-in that recomputes on
replay in the CPU tests) and returns a :class:`Captured` record or raises
:class:`~graphwrap.capture.checks.CaptureFailed`. It never touches the caller's tensors: the job's
sample is graphwrap's own copy, and a forward that writes into its inputs is found on that
copy and refused.
"""

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from .._compat import autocast_without_cache
from ..core.records import Graph
from ..core.tree import CONST, WHOLE, flatten_outputs
from .checks import (
    CaptureFailed,
    Scope,
    Verifier,
    check_rebuild,
    check_untouched,
    output_kinds,
    rows_and_length,
    run_module,
    shape_inputs,
)
from .constants import with_constants
from .cuda import (
    NotBegun,
    Pool,
    capture_session,
    check_stream,
    first_line,
    is_invalidated,
    record,
)

Tensor = torch.Tensor
logger = logging.getLogger("graphwrap")
# The caching allocator rounds allocations up into segments of up to 20 MiB: a bucket's
# estimated growth of the pool adds this much to the warm-up's peak.
ALLOCATOR_SLACK = 20 << 20
# Tries of a capture that something outside the forward invalidated.
CAPTURE_TRIES = 3


@dataclass(slots=True)
class Job:
    """Everything one capture needs."""

    module: Any
    forward: Any  # a CompiledForward, or None for the module itself
    device: torch.device
    pool: Any  # a streams.Pool (None in the CPU tests)
    spec: tuple
    roles: tuple
    batch_dim: int  # of the outputs
    real: List[Tensor]  # the sample's real rows on the device: graphwrap's own copies
    size: int
    seq: Optional[int]
    warmup_iters: int = 3
    autocast: Any = None
    verify: bool = True
    kinds: Optional[list] = None  # known from an earlier bucket of the key
    seq_dims: Optional[list] = None
    out_spec: Any = None
    budget_left: Optional[int] = None
    # Verification replays share the pool with served graphs: issued under this context.
    guard: Callable[[], Any] = contextlib.nullcontext
    describe: Callable[[int], str] = "#{}".format  # an input's name, for messages
    pad_check: bool = True  # verify that padding along the sequence leaves real positions alone
    # Puts back the module buffers the last run wrote (state.Saved.restore): every run of the
    # capture starts from the state the call found.
    restore: Callable[[], None] = lambda: None
    state: Any = None  # the state.Saved behind ``restore``, if any
    fixed: bool = False  # a state input fixes the batch: the call's own shape, no other is run
    # Around the reference run: notes which attributes of the module the forward reads (watch.reads_recorded).
    observe: Callable[[], Any] = contextlib.nullcontext


@dataclass(slots=True)
class Captured:
    graph: Graph
    kinds: list
    seq_dims: list
    out_spec: Any
    capture_s: float = 0.0
    verify_s: float = 0.0
    compile_s: float = 0.0
    compiled_graphs: int = 0
    ran_ahead: bool = False  # the compiled forward ran ahead of this capture (its graphs counted here)
    pool_bytes: int = 0
    pool_estimate: int = 0
    pool: Any = None  # a new pool, where an invalidated capture was taken again in one


@dataclass(slots=True)
class _Prepared:
    static_in: List[Tensor]
    real: List[Tensor]
    ref_real: list
    ref_pad: list
    kinds: list
    seq_dims: list
    out_spec: Any
    draws: bool
    writes: bool = False  # the forward writes state: the call's own shape, no padding to check


def capture_bucket(job: Job, recorder) -> Captured:
    """Capture one graph of ``job.module`` at ``job.size`` rows (and ``job.seq`` positions).

    Raises CaptureFailed when the graph cannot be trusted, and lets the module's own
    exceptions on the real rows through unchanged (eager would raise them too).
    """
    t0 = time.perf_counter()
    info: Dict[str, Any] = {}
    with recorder.session(job.device):
        p = _prepare(job, recorder, info)
        run = _runner(job, p.static_in)
        try:
            g, outs, pool_bytes, pool = recorder.record(job.device, job.pool, run, p.draws, job.size)
        except CaptureFailed as e:
            if job.forward is not None and e.scope is Scope.KEY:  # "the forward ..." of the compiled one
                e.scope, e.reason = Scope.COMPILE, "the compiled " + e.reason.removeprefix("the ")
            raise
        finally:
            job.restore()
    static_out, spec_c = flatten_outputs(outs)
    if spec_c != p.out_spec:
        raise CaptureFailed("the structure of the output differs between warm-up and capture")
    _, Lr = rows_and_length(p.real, job.roles)
    hi = [Lr if sd is not None else 0 for _, sd, _ in job.roles]
    graph = Graph(g, g.replay, job.size, job.seq, job.roles, job.batch_dim, p.static_in, static_out, p.kinds,
                  p.seq_dims, hi, run=run, draws=p.draws, pool=pool if pool is not None else job.pool)
    got = Captured(graph, p.kinds, p.seq_dims, p.out_spec, capture_s=time.perf_counter() - t0,
                   pool_bytes=pool_bytes, pool=pool, **info)
    if job.verify:
        check = Verifier(graph, job.module, job.spec, p.out_spec, p.ref_pad, p.ref_real, p.real, job.guard,
                         job.pad_check and not p.writes, job.restore, rows_check=not p.writes)
        got.verify_s = recorder.verify(job.device, job.autocast, check)
    return got


def _runner(job: Job, static_in):
    """The forward on the static inputs, as captured; it holds what it runs and nothing of the
    job (whose guard holds the engine: a graph keeping it would be a cycle)."""
    forward = job.module if job.forward is None else job.forward
    spec, autocast = job.spec, job.autocast

    def run():
        with torch.inference_mode(False), torch.no_grad(), autocast_without_cache(autocast):
            return run_module(forward, spec, static_in)
    # The plain forward's tensors of Python numbers are made on the device while it is captured;
    # a compiled forward is left alone (a mode would change what its guards see).
    return with_constants(run) if job.forward is None else run


def _prepare(job: Job, recorder, info: dict) -> _Prepared:
    """Reference runs, warm-ups and the output checks, before anything is recorded."""
    m, Lr = rows_and_length(job.real, job.roles)
    real = job.real
    if job.seq is not None and Lr > job.seq:
        real = shape_inputs(real, job.roles, m, job.seq)
    with torch.inference_mode(False), torch.no_grad(), autocast_without_cache(job.autocast):
        versions = [t._version for t in real]
        # The real rows alone, as eager runs them: the module's own errors surface here.
        with job.observe():
            out, draws = recorder.watch_random(lambda: run_module(job.module, job.spec, real))
        ref_real, spec_real = flatten_outputs(out)
        if job.state is not None:
            job.state.check_params()
            job.state.check_host_state()
        job.restore()
        check_untouched(real, versions, job.describe)
        # A forward that writes state (found by that run) is captured at the call's own shape only:
        # padding rows or positions would write state that the eager call does not.
        writes = job.fixed or (job.state is not None and bool(job.state.written))
        if writes and not job.fixed and (m != job.size or (job.seq is not None and Lr != job.seq)
                                         or job.forward is not None):
            err = CaptureFailed("the forward writes module buffers: captured at the call's own shape", scope=Scope.STATE)
            err.written = set(job.state.written)
            raise err
        static_in = shape_inputs(real, job.roles, job.size, job.seq)
        ref_pad, spec_pad = _warm_up(job, recorder, static_in, info)
        if spec_pad != spec_real:
            raise CaptureFailed("the structure of the output changes with the batch size")
        if job.out_spec is not None and spec_pad != job.out_spec:
            raise CaptureFailed("the structure of the output differs between buckets")
        check_rebuild(spec_pad, ref_pad)
        if job.kinds is None and writes:
            # Never padded, so nothing is cut: every output is returned whole, and no other shape
            # is run to tell which are batched (a cache of a fixed batch refuses any other).
            kinds = [WHOLE if isinstance(o, Tensor) else CONST for o in ref_pad]
            seq_dims: List[tuple] = [()] * len(ref_pad)
        elif job.kinds is None:
            job.restore()
            kinds, seq_dims = output_kinds(job.module, job.spec, job.roles, real, ref_real, ref_pad, job.size,
                                           job.seq, job.batch_dim, spec_pad)
            job.restore()
        else:
            kinds = job.kinds
            seq_dims = job.seq_dims if job.seq_dims is not None else [()] * len(kinds)
    return _Prepared(static_in, real, ref_real, ref_pad, kinds, seq_dims, spec_pad, draws, writes)


def _warm_up(job: Job, recorder, static_in, info):
    """Warm-up runs on the padded inputs, so cuBLAS workspaces, cuDNN and Triton autotuning and
    other lazy initialisation happen outside the capture; the last one's outputs."""
    forward = job.module if job.forward is None else job.forward
    compiled = job.forward
    t0 = time.perf_counter()
    try:
        if compiled is not None:
            compiled.mark(static_in, job.roles)
            ahead, compiled.ahead = compiled.ahead, None
            graphs0 = compiled.graphs - (ahead or 0)
            info["ran_ahead"] = ahead is not None
        for _ in range(job.warmup_iters):
            job.restore()
            ref, spec = flatten_outputs(run_module(forward, job.spec, static_in))
            if compiled is not None and "compile_s" not in info:
                info["compile_s"] = time.perf_counter() - t0  # tracing and compiling, if any
                info["compiled_graphs"] = compiled.graphs - graphs0
        if job.budget_left is not None:
            info["pool_estimate"] = recorder.check_budget(job.device, _runner(job, static_in), job.size,
                                                          job.budget_left)
            job.restore()
    except CaptureFailed:
        raise
    except torch.cuda.OutOfMemoryError as e:
        raise CaptureFailed(f"out of memory in warm-up at batch {job.size}", e, scope=Scope.BUCKET) from e
    except Exception as e:  # noqa: BLE001 - any failure here is padding-induced
        if compiled is not None:
            raise CaptureFailed(f"the compiled forward failed at batch {job.size}: {type(e).__name__}: "
                                f"{first_line(e)}", e, scope=Scope.COMPILE) from e
        raise CaptureFailed(f"the forward failed on the padded batch of {job.size} rows but not on the real rows: "
                            f"{type(e).__name__}: {e}", e) from e
    return ref, spec


def _failed(err: BaseException, size: int) -> CaptureFailed:
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return CaptureFailed(f"out of memory in capture at batch {size}", err, scope=Scope.BUCKET, pool_lost=True)
    return CaptureFailed(f"the forward cannot be captured in a CUDA graph: {type(err).__name__}: {first_line(err)}",
                         err, pool_lost=True)


class _SeededOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Notes whether any operator that draws from a random generator runs (this thread only)."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _note_seeded(self, func, types, args, kwargs)


class _SeededOpsNoDynamo(_SeededOps):
    """The same, its ``__torch_dispatch__`` left unwrapped by PyTorch's lazy Dynamo guard.

    PyTorch wraps a dispatch mode's handler so that Dynamo skips it, and the wrapper imports
    ``torch._dynamo`` on its first call: 3 to 4 s of a process's first capture on the H100
    machine, for a forward that compiles nothing. Where Dynamo is not loaded, nothing is being
    compiled, and this class is used instead."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # its own: the parent's is wrapped
        return _note_seeded(self, func, types, args, kwargs)


def _note_seeded(mode, func, types, args, kwargs):
    if not mode.seen and _SEEDED in getattr(func, "tags", ()):
        mode.seen = True
    return func(*args, **(kwargs or {}))


_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)


class CudaRecorder:
    """The CUDA side of a capture: the lock and side stream, memory, the capture itself, and
    the verification replays on a stream apart."""

    @staticmethod
    def session(device):
        return capture_session(device)

    @staticmethod
    def watch_random(fn):
        """``(fn(), whether it drew random numbers)``; True where that cannot be told."""
        if _SEEDED is None:
            return fn(), True
        plain = "torch._dynamo" not in sys.modules and hasattr(_SeededOps, "_should_skip_dynamo")
        mode = _SeededOpsNoDynamo() if plain else _SeededOps()
        with mode:
            out = fn()
        return out, mode.seen

    @staticmethod
    def check_budget(device, run, size, budget_left) -> int:
        """The pool bytes this bucket is estimated to need (one more warm-up's peak); CaptureFailed
        (Scope.BUDGET) if that is more than ``budget_left``. Capture streams keep their cuBLAS
        workspaces in a pool of their own (cuda.own_workspace): none of it counts here."""
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        need = torch.cuda.max_memory_allocated(device) - base + ALLOCATOR_SLACK
        if need > budget_left:
            err = CaptureFailed(f"bucket {size} needs about {need / 2**20:.1f} MiB of graph pool, "
                                f"{max(budget_left, 0) / 2**20:.1f} MiB of max_pool_bytes are left", scope=Scope.BUDGET)
            err.pool_estimate = need
            raise err
        return need

    def record(self, device, pool, run, draws: bool, size: int):
        """``(graph, outputs, pool bytes, new pool or None)``; a capture invalidated from outside
        is taken again in a new pool, up to CAPTURE_TRIES times."""
        new_pool = None
        for attempt in range(1, CAPTURE_TRIES + 1):
            try:
                g, outs, grown = self._record_once(device, new_pool or pool, run, draws, size)
                return g, outs, grown, new_pool
            except CaptureFailed as e:
                if not is_invalidated(e) or attempt == CAPTURE_TRIES:
                    raise
                logger.warning("capture of bucket %d invalidated (%s); capturing it again in a new pool",
                               size, e.reason)
                torch.cuda.synchronize(device)
                new_pool = Pool(device)
        raise AssertionError("unreachable")

    @staticmethod
    def _record_once(device, pool, run, draws, size):
        torch.cuda.synchronize(device)
        reserved0 = torch.cuda.memory_reserved(device)
        graph = torch.cuda.CUDAGraph()
        try:
            out = record(graph, pool, device, draws, run)
        except NotBegun as e:  # the pool is still recording an earlier, failed capture
            raise CaptureFailed(f"the capture could not begin: {e}", e, pool_lost=True) from e
        except BaseException as e:  # noqa: BLE001 - the forward's own failure inside the capture
            raise _failed(e, size) from e
        return graph, out, torch.cuda.memory_reserved(device) - reserved0

    @staticmethod
    def verify(device, autocast, check) -> float:
        """Run the verification on a stream apart (its replays under the job's guard); the
        seconds taken."""
        t0 = time.perf_counter()
        cur = torch.cuda.current_stream(device)
        vs = check_stream(device)
        vs.wait_stream(cur)
        with torch.cuda.device(device), torch.cuda.stream(vs), torch.inference_mode(False), torch.no_grad(), \
                autocast_without_cache(autocast):
            check()
        cur.wait_stream(vs)
        return time.perf_counter() - t0
