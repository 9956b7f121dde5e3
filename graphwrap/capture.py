"""The CUDA work: warm-up on a side stream, capture into a shared pool, and verification.

Everything that decides (keys, buckets, output kinds, comparisons) lives in plain-Python
modules; this file only runs the module, captures it and checks the capture.
"""

import contextlib
import gc
import logging
import statistics
import threading
import time
from typing import Any, List, Optional, Sequence

import torch

from ._compat import autocast_without_cache, capture_begin, end_allocate_to_pool
from .tree import BATCHED, CONST, WHOLE, OutputSpec, classify_outputs, flatten_outputs, unflatten_inputs
from .verify import CROSS_SHAPE_TOL, SAME_SHAPE_TOL, compare_leaves

Tensor = torch.Tensor
logger = logging.getLogger("graphwrap")


# One capture at a time in the process: a capture is process-wide state for PyTorch's
# allocator and RNG. Warm-up and capture run on one side stream per device, shared by every
# GraphedModule (each stream that runs a GEMM keeps a cuBLAS workspace for the process).
CAPTURE_LOCK = threading.RLock()
_SIDE_STREAMS = {}
_CHECK_STREAMS = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream graphwrap warms up and captures on: one per device, graphwrap's alone."""
    s = _SIDE_STREAMS.get(device)
    if s is None:
        s = _SIDE_STREAMS[device] = private_stream(device)
    return s


def check_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream verification replays run on: they run outside the capture lock, so never on
    the capture stream."""
    s = _CHECK_STREAMS.get(device)
    if s is None:
        s = _CHECK_STREAMS[device] = torch.cuda.Stream(device)
    return s


def private_stream(device: torch.device) -> torch.cuda.Stream:
    """A non-blocking stream that no other code in the process is handed.

    ``torch.cuda.Stream()`` hands out the streams of a small pool in turn (32 per device and
    priority), so after enough of them another thread's stream is the same CUDA stream as one
    of ours. Work issued there while graphwrap captures on it would land in the graph, or
    invalidate the capture ("capturing stream has unjoined work", a generator "not in capture
    mode", a failed cuBLAS call). This stream is created through the driver instead, so it is
    nobody else's; where that is not possible, a stream of the high-priority pool is taken
    (rarer in other code, but not exclusive), and the log says so.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        torch.cuda.current_stream()  # the device's primary context exists from here on
        try:
            handle = _driver_stream(index)
            return torch.cuda.ExternalStream(handle, device=torch.device("cuda", index))
        except Exception as e:  # noqa: BLE001 - any failure of the driver route has the same answer
            logger.info("graphwrap: no stream of graphwrap's own on cuda:%d (%s: %s); capturing on a "
                        "high-priority stream of PyTorch's pool", index, type(e).__name__, _first_line(e))
            return torch.cuda.Stream(index, priority=-1)


def _driver_stream(index: int) -> int:
    """``cuStreamCreate(CU_STREAM_NON_BLOCKING)`` in the device's primary context; the handle."""
    import ctypes
    import sys

    lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")

    def check(what, status):
        if status != 0:
            raise RuntimeError(f"{what} returned CUDA driver error {status}")

    dev, ctx, stream = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(index)))
    check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    check("cuCtxPushCurrent", lib.cuCtxPushCurrent_v2(ctx))
    try:
        check("cuStreamCreate", lib.cuStreamCreate(ctypes.byref(stream), ctypes.c_uint(1)))
    finally:
        lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    if not stream.value:
        raise RuntimeError("cuStreamCreate gave no stream")
    return stream.value


_clear_cublas_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)


def _own_cublas_workspace():
    """Make the next captured GEMM allocate its cuBLAS workspace inside the capture's pool.

    A captured GEMM keeps the address of its stream's cuBLAS workspace. A workspace made
    before the capture lives in the ordinary allocator, and whoever clears the workspaces
    (torch.compile's CUDA graphs do, around each recording; so do many memory clean-ups) would
    free it under the graph. Cleared before the capture, the workspace is allocated in the
    graph's pool; cleared after it, no eager GEMM elsewhere uses that memory, and it goes with
    the pool.
    """
    if _clear_cublas_workspaces is not None:
        _clear_cublas_workspaces()


@contextlib.contextmanager
def no_gc_during_capture():
    """Hold Python's cyclic garbage collector off while this thread captures.

    A collection that runs inside a capture frees whatever dead cycles it finds, here and now:
    a dropped module's CUDA graphs, events, pinned buffers. Destroying a graph is not allowed
    while the thread captures; the call fails, and it invalidates the capture, so the next
    kernel (typically a cuBLAS GEMM) fails with "operation failed due to a previous error
    during capture". Without the collector, nothing but the forward's own objects is freed in
    the capture. Captures are short and taken one at a time (CAPTURE_LOCK).
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _reset_rng_capture_state(device):
    """Close the RNG's capture phase after a failed capture.

    When ending a capture fails, PyTorch raises before the CUDA generator leaves its capture
    phase, and every later random op or graph replay on the device then fails. A small capture
    that succeeds runs the generator's prologue and epilogue, which puts it back. It uses a
    pool of its own.
    """
    t = torch.zeros(1, device=device)
    g = torch.cuda.CUDAGraph()
    with no_gc_during_capture():
        capture_begin(g, None)
        t.add_(1)
        g.capture_end()


def _after_failed_capture(device, pool):
    """Undo what a capture that raised left behind: the allocator still routing the capture
    stream into ``pool``, and the generator still in its capture phase."""
    end_allocate_to_pool(device, pool)
    try:
        _reset_rng_capture_state(device)
    except Exception as e:  # noqa: BLE001 - the original failure is the one to report
        logger.warning("graphwrap: could not close the RNG's capture phase after a failed capture: %s: %s",
                       type(e).__name__, _first_line(e))


# Tries of a capture that something outside the forward invalidated.
CAPTURE_TRIES = 3


def _is_invalidated(e: BaseException) -> bool:
    """A capture that failed through no fault of the forward, as far as can be told: invalidated
    from outside (an illegal call elsewhere in the thread, a synchronization of the whole
    device from another thread), or a pool left recording by an earlier failure."""
    text = str(e)
    return any(s in text for s in ("previous error during capture", "already recording", "unjoined"))


def copy_graph(device: torch.device, pool, dsts, srcs):
    """A captured graph that copies each of ``srcs`` into the matching one of ``dsts``; its replay.

    One launch, whatever the number of outputs: the host cost of owned outputs (see
    :mod:`graphwrap.outputs`). It allocates nothing, so it shares the bucket graphs' pool.
    Raises CaptureFailed when the capture fails (the allocator and the generator are left as
    they were before it).
    """
    graph = torch.cuda.CUDAGraph()
    with CAPTURE_LOCK:
        stream = side_stream(device)
        cur = torch.cuda.current_stream(device)
        stream.wait_stream(cur)
        with torch.cuda.stream(stream), no_gc_during_capture():
            began = False
            try:
                capture_begin(graph, pool)
                began = True
                for d, s in zip(dsts, srcs):
                    d.copy_(s)
                graph.capture_end()
            except Exception as e:
                if began:
                    _after_failed_capture(device, pool)
                raise CaptureFailed(f"the output copy could not be captured: {type(e).__name__}: "
                                    f"{_first_line(e)}", e, pool_lost=began and _is_invalidated(e)) from e
        cur.wait_stream(stream)
    return graph.replay


# The caching allocator rounds allocations up into segments of up to 20 MiB: a bucket's
# estimated growth of the pool adds this much to the warm-up's peak.
ALLOCATOR_SLACK = 20 << 20


class CaptureFailed(Exception):
    """A bucket could not be captured or did not verify.

    ``scope`` is "key" when every bucket of the key would fail the same way (a host sync in
    forward, a model that mixes rows), "bucket" when only this size failed (out of memory),
    "budget" when the bucket would take the graph pool over its budget, "compile" when the
    compiled forward failed (the plain forward may still capture).
    """

    def __init__(self, reason: str, cause: Optional[BaseException] = None, scope: str = "key",
                 pool_lost: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.cause = cause
        self.scope = scope
        self.pool_lost = pool_lost  # the pool cannot take further captures
        self.pool_estimate = 0  # scope "budget": the bytes the bucket was estimated to need


class Replica:
    """One captured graph of one bucket, with its static inputs and outputs."""

    __slots__ = (
        "graph", "size", "batch_dim", "static_inputs", "static_outputs", "kinds", "is_tensor",
        "_in_views", "_out_views", "copy_done", "replay_done", "out_bytes", "ring",
    )

    def __init__(self, graph, size: int, batch_dim: int, static_inputs, static_outputs, kinds):
        self.graph = graph
        self.size = size
        self.batch_dim = batch_dim
        self.static_inputs: List[Tensor] = static_inputs
        self.static_outputs: List[Any] = static_outputs
        self.kinds: List[str] = kinds
        self.is_tensor = [k != CONST for k in kinds]
        self.out_bytes = sum(o.numel() * o.element_size() for o in static_outputs if isinstance(o, Tensor))
        self._in_views = {}
        self._out_views = {}
        # Set by the pipeline: the last copy into this replica's inputs, the last replay of it.
        self.copy_done = None
        self.replay_done = None
        self.ring = None  # owned-output slots (graphwrap.outputs), set by the engine

    def inputs_for(self, n: int) -> List[Tensor]:
        """Views of the first ``n`` rows of each static input (cached: built once per n)."""
        v = self._in_views.get(n)
        if v is None:
            bd = self.batch_dim
            v = [t if n == self.size else t.narrow(bd, 0, n) for t in self.static_inputs]
            self._in_views[n] = v
        return v

    def outputs_for(self, n: int) -> List[Any]:
        """The static outputs cut back to ``n`` rows (cached views; valid until the next replay)."""
        v = self._out_views.get(n)
        if v is None:
            bd = self.batch_dim
            v = [
                o.narrow(bd, 0, n) if k == BATCHED and n != self.size else o
                for o, k in zip(self.static_outputs, self.kinds)
            ]
            self._out_views[n] = v
        return v

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.static_inputs)


def device_sync(device=None) -> None:
    """``torch.cuda.synchronize`` that never runs while this process captures.

    A device-wide synchronization from another thread can invalidate a capture on the same
    GPU, whatever the capture mode; graphwrap's own waits for the whole device take the
    capture lock, so they never meet a capture of graphwrap's.
    """
    with CAPTURE_LOCK:
        torch.cuda.synchronize(device)


def timed_calls(fn, k: int) -> float:
    """Seconds per call of ``fn(k)``, which makes ``k`` calls; the device synchronized around it."""
    device_sync()
    t0 = time.perf_counter()
    fn(k)
    device_sync()
    return (time.perf_counter() - t0) / k


def race(replica: Replica, eager_call, clone: bool, rounds: int = 3, round_s: float = 2e-3):
    """Seconds per call of this bucket through its graph and eagerly, timed back to back.

    The graph's call is what ``gm(...)`` does: copy inputs in (from device tensors), replay,
    clone the outputs if ``clone``; eager's is ``eager_call`` on the same inputs. Each round
    times a few calls of each with the device synchronized around them (so both host and
    device time count); medians over the rounds. A graph at least twice as fast in the first
    round needs no more rounds.
    """
    src = [t.clone() for t in replica.static_inputs]
    dsts, graph, outs = replica.static_inputs, replica.graph, replica.static_outputs
    tensors = [o for o, t in zip(outs, replica.is_tensor) if t]

    def graph_calls(k):
        for _ in range(k):
            for d, s in zip(dsts, src):
                d.copy_(s)
            graph.replay()
            if clone:
                for o in tensors:
                    o.clone()

    def eager_calls(k):
        for _ in range(k):
            eager_call(src)

    with torch.inference_mode(False), torch.no_grad():
        return time_pair(graph_calls, eager_calls, rounds, round_s, stop_early=lambda g, e: 2 * g <= e)


def time_pair(a_calls, b_calls, rounds: int, round_s: float, stop_early=None, timed=timed_calls):
    """Seconds per call of ``a_calls(k)`` and ``b_calls(k)`` (each makes ``k`` calls), timed in
    turns round by round with ``timed``; medians over the rounds. ``k`` makes a round last about
    ``round_s``; ``stop_early(a_s, b_s)``, if given, may end the timing after the first round."""
    once = max(timed(a_calls, 1), timed(b_calls, 1))
    k = max(1, min(64, int(round_s / max(once, 1e-6))))
    xs, ys = [], []
    for r in range(rounds):
        xs.append(timed(a_calls, k))
        ys.append(timed(b_calls, k))
        if r == 0 and stop_early is not None and stop_early(xs[0], ys[0]):
            break
    return statistics.median(xs), statistics.median(ys)


def tile_rows(x: Tensor, rows: int, size: int, batch_dim: int) -> Tensor:
    """A new ``size``-row tensor whose rows repeat the first ``rows`` rows of ``x`` in order.

    Padding rows are always copies of real rows: never uninitialised memory, which can hold
    NaN (poisoning a softmax) or an index out of range (a device assert in an embedding).
    """
    idx = torch.arange(size, device=x.device) % rows
    return x.narrow(batch_dim, 0, rows).index_select(batch_dim, idx)


def _perturb(rows: Tensor, batch_dim: int) -> Tensor:
    # Other valid contents: the same rows in reverse order, and for floats halved as well
    # (halving keeps non-negative float indices in range, unlike noise or a sign flip).
    p = rows.flip(batch_dim)
    if p.is_floating_point() or p.is_complex():
        p = p * 0.5
    return p


def run_module(module, in_spec, leaves):
    args, kwargs = unflatten_inputs(in_spec, leaves)
    return module(*args, **kwargs)


def _kept(outputs: Sequence[Any], kinds: Sequence[str], keep: int, batch_dim: int) -> List[Any]:
    out = []
    for o, k in zip(outputs, kinds):
        if k == BATCHED:
            out.append(o.narrow(batch_dim, 0, keep).clone())
        elif k == WHOLE:
            out.append(o.clone())
        else:
            out.append(o)
    return out


def capture_bucket(
    *,
    module,
    device: torch.device,
    pool,
    in_spec,
    sample: Sequence[Tensor],
    size: int,
    batch_dim: int,
    warmup_iters: int,
    autocast_dtype,
    verify: bool,
    kinds: Optional[List[str]],
    out_spec: Optional[OutputSpec],
    compiled=None,
    budget_left: Optional[int] = None,
    replay_lock=None,
):
    """Capture one graph of ``module`` at ``size`` rows, with ``sample`` (on ``device``) as inputs.

    ``sample`` holds m <= size real rows; the static inputs repeat them up to ``size``. Returns
    ``(replica, info)``; raises CaptureFailed when the graph cannot be trusted, and lets the
    module's own exceptions on the real rows through unchanged (eager would raise them too).

    With ``compiled`` (a CompiledForward), warm-up and capture run the compiled forward and the
    eager module is the reference it is verified against. With ``budget_left`` (bytes), the
    pool growth is estimated from a warm-up's peak memory first, and a bucket that would not
    fit raises CaptureFailed with scope "budget". With ``replay_lock``, the verification replays
    run under it: graphs of one pool share memory, so no two may replay at once. Verification
    runs after the process-wide capture lock is released, so the two locks are never held in
    the order opposite to a call's (its lock, then a capture).

    A capture that something outside the forward invalidated ("operation failed due to a
    previous error during capture") is tried again, up to CAPTURE_TRIES times in all, each time
    in a new pool, before it counts as failed; ``info["pool"]`` is then the pool the graph went
    into, which the caller's later captures must use.
    """
    stream = side_stream(device)
    args = (module, device, pool, stream, in_spec, sample, size, batch_dim, warmup_iters,
            autocast_dtype, verify, kinds, out_spec, compiled, budget_left)
    with CAPTURE_LOCK:
        new_pool = None
        for attempt in range(1, CAPTURE_TRIES + 1):
            try:
                replica, info, check = _capture_bucket(*args)
                break
            except CaptureFailed as e:
                if not _is_invalidated(e) or attempt == CAPTURE_TRIES:
                    raise
                logger.warning("graphwrap: capture of bucket %d invalidated (%s); capturing it again in a new pool",
                               size, e.reason)
                torch.cuda.synchronize(device)
                new_pool = torch.cuda.graph_pool_handle()
                args = args[:2] + (new_pool,) + args[3:]
        if new_pool is not None:
            info["pool"] = new_pool
    if check is not None:
        t1 = time.perf_counter()
        cur = torch.cuda.current_stream(device)
        vs = check_stream(device)
        with replay_lock if replay_lock is not None else contextlib.nullcontext():
            vs.wait_stream(cur)
            with torch.cuda.stream(vs), torch.inference_mode(False), torch.no_grad(), \
                    autocast_without_cache(autocast_dtype):
                check()
            cur.wait_stream(vs)
        info["verify_s"] = time.perf_counter() - t1
    return replica, info


def _capture_bucket(module, device, pool, stream, in_spec, sample, size, batch_dim,
                    warmup_iters, autocast_dtype, verify, kinds, out_spec, compiled, budget_left):
    """The capture proper; returns ``(replica, info, check)``, ``check`` the verification to run
    (None without ``verify``)."""
    m = sample[0].shape[batch_dim]
    info = {"capture_s": 0.0, "verify_s": 0.0, "pool_bytes": 0, "compile_s": 0.0, "compiled_graphs": 0,
            "pool_estimate": 0}
    forward = module if compiled is None else compiled
    t0 = time.perf_counter()
    cur = torch.cuda.current_stream(device)
    with torch.inference_mode(False), torch.no_grad(), autocast_without_cache(autocast_dtype):
        static_in = [tile_rows(x, m, size, batch_dim) for x in sample]
        if compiled is not None:
            compiled.mark(static_in, batch_dim)
        stream.wait_stream(cur)
        with torch.cuda.stream(stream):
            # The real rows alone, as eager runs them: the module's own errors surface here.
            ref_m, spec_m = flatten_outputs(run_module(module, in_spec, sample))
            try:
                # Warm-up on the side stream, so cuBLAS workspaces, cuDNN and Triton
                # autotuning and other lazy initialisation happen outside the capture.
                if compiled is not None:
                    graphs0 = compiled.graphs
                    ref_b, spec_b = flatten_outputs(run_module(forward, in_spec, static_in))
                    info["compile_s"] = time.perf_counter() - t0  # tracing and compiling, if any
                    info["compiled_graphs"] = compiled.graphs - graphs0
                for _ in range(warmup_iters - (compiled is not None)):
                    ref_b, spec_b = flatten_outputs(run_module(forward, in_spec, static_in))
                if budget_left is not None:
                    info["pool_estimate"] = _check_budget(forward, in_spec, static_in, device, size, budget_left)
            except CaptureFailed:
                raise
            except torch.cuda.OutOfMemoryError as e:
                raise CaptureFailed(f"out of memory in warm-up at batch {size}", e, scope="bucket") from e
            except Exception as e:  # noqa: BLE001 - any failure here is padding-induced
                if compiled is not None:
                    raise CaptureFailed(
                        f"the compiled forward failed at batch {size}: {type(e).__name__}: {_first_line(e)}",
                        e, scope="compile",
                    ) from e
                raise CaptureFailed(
                    f"the forward failed on the padded batch of {size} rows but not on the {m} real rows: "
                    f"{type(e).__name__}: {e}", e
                ) from e
            if spec_b != spec_m:
                raise CaptureFailed("the structure of the output changes with the batch size")
            if out_spec is not None and spec_b != out_spec:
                raise CaptureFailed("the structure of the output differs between buckets")
            _check_rebuild(spec_b, ref_b)
            if kinds is None:
                kinds = _output_kinds(module, in_spec, sample, ref_m, ref_b, m, size, batch_dim, spec_b)

            torch.cuda.synchronize(device)
            reserved0 = torch.cuda.memory_reserved(device)
            graph = torch.cuda.CUDAGraph()
            err = None
            _own_cublas_workspace()
            with no_gc_during_capture():
                try:
                    capture_begin(graph, pool)
                except RuntimeError as e:  # the pool is still recording an earlier, failed capture
                    raise CaptureFailed(f"the capture could not begin: {_first_line(e)}", e,
                                        pool_lost=True) from e
                try:
                    out = run_module(forward, in_spec, static_in)
                except BaseException as e:  # noqa: BLE001 - the capture must be ended whatever happened
                    err = e
                try:
                    graph.capture_end()
                except BaseException as e:  # noqa: BLE001
                    err = err or e
            _own_cublas_workspace()
            if err is not None:
                del graph
                _after_failed_capture(device, pool)
                if isinstance(err, torch.cuda.OutOfMemoryError):
                    raise CaptureFailed(f"out of memory in capture at batch {size}", err, scope="bucket",
                                        pool_lost=True) from err
                raise CaptureFailed(
                    f"the {'compiled ' if compiled is not None else ''}forward cannot be captured in a "
                    f"CUDA graph: {type(err).__name__}: {_first_line(err)}", err, pool_lost=True,
                    scope="compile" if compiled is not None else "key",
                ) from err
            info["pool_bytes"] = torch.cuda.memory_reserved(device) - reserved0
            static_out, spec_c = flatten_outputs(out)
            if spec_c != spec_b:
                raise CaptureFailed("the structure of the output differs between warm-up and capture")
            replica = Replica(graph, size, batch_dim, static_in, static_out, kinds)
            info["capture_s"] = time.perf_counter() - t0
        cur.wait_stream(stream)
    check = (lambda: _verify(replica, ref_b, ref_m, m, spec_b)) if verify else None
    info["kinds"] = kinds
    info["out_spec"] = spec_b
    return replica, info, check


def _check_rebuild(spec: OutputSpec, leaves) -> None:
    """Every call rebuilds the output from its parts: check that this gives back the output.

    A container whose constructor takes other arguments than what it holds (a dict subclass
    that wants a name first, say) could otherwise come back empty, or raise on every call.
    """
    try:
        back, back_spec = flatten_outputs(spec.rebuild(leaves))
    except Exception as e:  # noqa: BLE001 - whatever the type's constructor raises
        raise CaptureFailed(f"the output cannot be rebuilt from its parts: {type(e).__name__}: {_first_line(e)}",
                            e) from e
    if back_spec != spec or len(back) != len(leaves) or not all(map(_same_leaf, back, leaves)):
        where = spec.first_difference(back_spec) if back_spec != spec else "a part of it"
        raise CaptureFailed(
            f"the output cannot be rebuilt from its parts: rebuilt, it is not what the module returned ({where} "
            "differs; a container type whose constructor takes other arguments than its contents?)"
        )


def _same_leaf(a, b) -> bool:
    if a is b:
        return True
    try:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                    and bool(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))))
        return bool(a == b)
    except Exception:  # noqa: BLE001 - what cannot be compared is not known to be the same
        return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _check_budget(forward, in_spec, static_in, device, size, budget_left) -> int:
    """The bytes of graph pool this bucket is estimated to need; CaptureFailed (scope "budget")
    if that is more than ``budget_left``.

    The pool needs about the forward's peak memory: one more warm-up run measures it, with the
    cuBLAS workspaces cleared first so that the workspace the capture allocates in the pool is
    counted too.
    """
    _own_cublas_workspace()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_module(forward, in_spec, static_in)
    torch.cuda.synchronize(device)
    need = torch.cuda.max_memory_allocated(device) - base + ALLOCATOR_SLACK
    if need > budget_left:
        err = CaptureFailed(
            f"bucket {size} needs about {need / 2**20:.1f} MiB of graph pool, {max(budget_left, 0) / 2**20:.1f} "
            "MiB of max_pool_bytes are left", scope="budget",
        )
        err.pool_estimate = need
        raise err
    return need


def _output_kinds(module, in_spec, sample, ref_m, ref_b, m, size, batch_dim, spec):
    """Which outputs are batched, from the outputs at two different batch sizes."""
    if m != size:
        other, k = ref_m, m
    else:
        k = size - 1 if size > 1 else 2
        other, _ = flatten_outputs(run_module(module, in_spec, [tile_rows(x, m, k, batch_dim) for x in sample]))
    kinds, problems = classify_outputs(ref_b, size, other, k, batch_dim, spec)
    if problems:
        raise CaptureFailed(next(iter(problems.values())))
    whole = [i for i, kind in enumerate(kinds) if kind == WHOLE]
    msg = compare_leaves([ref_b[i] for i in whole], [other[i] for i in whole], CROSS_SHAPE_TOL,
                         names=lambda j: f"output {spec.describe(whole[j])}")
    if msg:
        raise CaptureFailed(
            f"{msg}: an output without a batch dimension changes with the batch, so it cannot come "
            "from a padded graph"
        )
    return kinds


def _verify(replica: Replica, ref_b, ref_m, m: int, spec: OutputSpec):
    """Replay on the warm-up inputs and against changed padding; raise CaptureFailed on a mismatch."""
    g, bd, size = replica.graph, replica.batch_dim, replica.size
    names = spec.describe
    g.replay()
    msg = compare_leaves(replica.static_outputs, ref_b, SAME_SHAPE_TOL, names=lambda i: f"output {names(i)}")
    if msg:
        raise CaptureFailed(
            f"replay differs from eager on the same inputs ({msg}); the forward probably does work on "
            "the host (Python-side state, CPU tensors, random numbers) that a graph replays frozen"
        )
    msg = compare_leaves(replica.outputs_for(m), ref_m, CROSS_SHAPE_TOL, names=lambda i: f"output {names(i)}")
    if msg:
        raise CaptureFailed(
            f"with {size - m} padding rows, the {m} real rows differ from eager on the real rows alone "
            f"({msg}); the model mixes rows of the batch"
        )
    if size < 2:
        return
    keep = m if m < size else size // 2
    before = _kept(replica.static_outputs, replica.kinds, keep, bd)
    saved = [t.clone() for t in replica.static_inputs]
    for t in replica.static_inputs:
        rows = t.narrow(bd, keep, size - keep)
        rows.copy_(_perturb(rows, bd))
    g.replay()
    after = _kept(replica.static_outputs, replica.kinds, keep, bd)
    for t, s in zip(replica.static_inputs, saved):
        t.copy_(s)
    msg = compare_leaves(after, before, SAME_SHAPE_TOL, names=lambda i: f"output {names(i)}")
    if msg:
        raise CaptureFailed(
            f"changing rows {keep}..{size - 1} of the batch changed the outputs of rows 0..{keep - 1} "
            f"({msg}); the model mixes rows of the batch (batch statistics, a reduction over dim "
            f"{bd}), so padding would change real results"
        )
