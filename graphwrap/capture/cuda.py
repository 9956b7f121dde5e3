"""The CUDA housekeeping around captures: one capture at a time, streams nobody else is handed,
device-wide waits that never meet a capture, and the state a failed capture leaves behind.
"""

import contextlib
import ctypes
import functools
import gc
import logging
import os
import sys
import time
import weakref
from typing import Optional

import torch

from .._compat import capture_begin, end_allocate_to_pool
from ..process import (
    CAPTURE_LOCK,
    CAPTURE_STREAMS_FREE,
    CHECK_STREAMS,
    SIDE_STREAMS,
    WORKSPACE_POOLS,
    WORKSPACES_PLACED,
)

logger = logging.getLogger("graphwrap")

# One capture at a time in the process: a capture is process-wide state for PyTorch's
# allocator and RNG. Warm-ups run on one side stream per device, shared by every GraphedModule;
# captures run on a stream of their pool's own (see Pool).
_GRAPHSAFE = all(hasattr(torch.Generator, n) for n in ("graphsafe_get_state", "graphsafe_set_state", "clone_state"))



def use_device(device: torch.device) -> None:
    """Make ``device`` this thread's current CUDA device (nothing for a CPU). A thread that serves
    a model on a GPU other than the process's current one needs it: new streams, Triton's
    launches and events read the current device, not the tensors' (``Replicas`` on ``cuda:1``)."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)


def stream_after(device: torch.device) -> Optional[torch.cuda.Stream]:
    """A stream for a thread of its own on ``device`` (None on a CPU), whose work comes after
    what this thread's current stream has queued: a thread that reads tensors made here (a
    cache zeroed, a table written) must not read them before they are written."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def on_device(device: Optional[torch.device]):
    """A context with ``device`` the current CUDA device where it is a GPU other than the current
    one (else nothing: one C call on the per-call path)."""
    if device is not None and device.type == "cuda" and device.index is not None \
            and device.index != torch._C._cuda_getDevice():
        return torch.cuda.device(device.index)
    return contextlib.nullcontext()


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream graphwrap warms up and captures on: one per device, graphwrap's alone."""
    s = SIDE_STREAMS.get(device)
    if s is None:
        s = SIDE_STREAMS[device] = private_stream(device)
    return s


@contextlib.contextmanager
def capture_session(device: torch.device):
    """Hold the process-wide capture lock and issue work on the device's side stream, ordered
    after the caller's current stream; the caller's stream waits for it at the end."""
    with CAPTURE_LOCK:
        stream = side_stream(device)
        cur = torch.cuda.current_stream(device)
        stream.wait_stream(cur)
        try:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                yield
        finally:
            cur.wait_stream(stream)


def check_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream verification replays run on: they run outside the capture lock, so never on
    the capture stream."""
    s = CHECK_STREAMS.get(device)
    if s is None:
        s = CHECK_STREAMS[device] = private_stream(device)
    return s


def private_stream(device: torch.device) -> torch.cuda.Stream:
    """A non-blocking stream that no other code in the process is handed.

    ``torch.cuda.Stream()`` hands out the streams of a small pool in turn (32 per device and
    priority), so after enough of them another thread's stream is the same CUDA stream as one
    of ours. Work issued there while graphwrap captures on it would land in the graph, or
    invalidate the capture. This stream is created through the driver instead, so it is
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
            logger.info("no stream of graphwrap's own on cuda:%d (%s: %s); capturing on a "
                        "high-priority stream of PyTorch's pool", index, type(e).__name__, first_line(e))
            return torch.cuda.Stream(index, priority=-1)


def _driver_stream(index: int) -> int:
    """``cuStreamCreate(CU_STREAM_NON_BLOCKING)`` in the device's primary context; the handle."""
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


@contextlib.contextmanager
def no_gc_during_capture():
    """Hold Python's cyclic garbage collector off while this thread captures.

    A collection inside a capture frees whatever dead cycles it finds, here and now: a dropped
    module's CUDA graphs, events, pinned buffers. Destroying a graph is not allowed while the
    thread captures; the call fails and invalidates the capture. Captures are short and taken
    one at a time (CAPTURE_LOCK).
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def begin(graph, pool, device: torch.device, draws_random: bool):
    """Begin a capture with the default CUDA generator kept apart, where torch allows it.

    A capture puts the default generator's state into capture mode for as long as it lasts,
    and any other thread drawing random numbers on the device meanwhile fails ("Offset
    increment outside graph capture"). A forward that draws none needs none of it: the capture
    begins with a private state of graphwrap's in its place (one per device, made once, so that
    nothing is allocated while it stands in), and the default state is put back at once. Other
    threads are kept out only while ``capture_begin`` runs: torch registers whatever state the
    default generator holds then, with the GIL released, so a thread drawing in that moment
    still fails (see docs/contract.md). A forward that draws random numbers is captured with the
    default state, as PyTorch does.
    """
    if draws_random or not _GRAPHSAFE:
        capture_begin(graph, pool)
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    gen = torch.cuda.default_generators[index]
    private = _PRIVATE_STATES.get(index)
    if private is None:
        # Seeded apart: a draw that lands in the moment the state stands in gets numbers of
        # its own, never a repeat of the default stream's next ones.
        private = _PRIVATE_STATES[index] = gen.clone_state()
        private.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    old = gen.graphsafe_get_state()
    gen.graphsafe_set_state(private)
    try:
        capture_begin(graph, pool)
    finally:
        gen.graphsafe_set_state(old)


_PRIVATE_STATES: dict = {}  # device index -> the generator state captures of forwards that draw nothing register


class NotBegun(RuntimeError):
    """A capture that could not begin (a pool still recording an earlier, failed capture)."""


def record(graph, pool: "Pool", device: torch.device, draws_random: bool, body, matmuls: bool = True):
    """Capture what ``body()`` issues into ``graph``, in ``pool`` and on the pool's capture stream
    (ordered after the current stream's work, which waits for the capture's in turn); what it
    returns. The capture is ended whatever happens inside it, so a stream is never left
    capturing; if anything failed, the allocator and the generator are put back and the first
    error is raised (:class:`NotBegun` where the capture could not begin at all). ``matmuls``:
    False where ``body`` makes no matrix product (no cuBLAS workspace is placed for it: a new
    pair of thread and stream would keep one, 32 MiB on Hopper)."""
    cur = torch.cuda.current_stream(device)
    stream = pool.stream
    stream.wait_stream(cur)
    try:
        with torch.cuda.stream(stream):
            if matmuls and not own_workspace(device):
                pool.recycle[0] = False  # its workspace lies in this pool: the stream dies with it
            return _record(graph, pool.handle, device, draws_random, body)
    finally:
        cur.wait_stream(stream)


def _record(graph, handle, device: torch.device, draws_random: bool, body):
    err = out = None
    with no_gc_during_capture():
        try:
            begin(graph, handle, device, draws_random)
        except RuntimeError as e:
            if draws_random or not _GRAPHSAFE:
                # The default generator's state was put in capture mode before the capture could
                # begin: every later draw in the process would fail. Close that phase.
                ensure_generator_usable(device)
            raise NotBegun(first_line(e)) from e
        try:
            out = body()
        except BaseException as e:  # noqa: BLE001 - the capture must be ended whatever happened
            err = e
        try:
            graph.capture_end()
        except BaseException as e:  # noqa: BLE001
            err = err or e
    if err is not None:
        after_failed_capture(device, handle, draws_random)
        raise err
    if draws_random or not _GRAPHSAFE:  # the default generator took part in the capture
        ensure_generator_usable(device)
    return out


def _reset_rng_capture_state(device):
    """Close the RNG's capture phase after a failed capture: a small capture that succeeds runs
    the generator's prologue and epilogue, which puts it back. It uses a pool of its own, and
    graphwrap's side stream (a capture on the default stream fails after the prologue, which
    would leave the generator as it found it)."""
    t = torch.zeros(1, device=device)
    g = torch.cuda.CUDAGraph()
    with CAPTURE_LOCK, no_gc_during_capture():
        stream = side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            capture_begin(g, None)
            try:
                t.add_(1)
            finally:
                g.capture_end()
        torch.cuda.current_stream(device).wait_stream(stream)


def after_failed_capture(device, pool, draws_random: bool = True):
    """Undo what a capture that raised left behind: the allocator still routing the capture
    stream into ``pool``, and (where the default generator took part) its capture phase."""
    end_allocate_to_pool(device, pool)
    if draws_random or not _GRAPHSAFE:
        try:
            _reset_rng_capture_state(device)
        except Exception as e:  # noqa: BLE001 - the original failure is the one to report
            logger.warning("could not close the RNG's capture phase after a failed capture: %s: %s",
                           type(e).__name__, first_line(e))
    ensure_generator_usable(device)


_STUCK = "Offset increment outside graph capture"


def ensure_generator_usable(device) -> bool:
    """Make sure the default CUDA generator is out of capture mode once a capture is over.

    A capture that ends abnormally can leave the generator's state marked as capturing, and
    every later random draw in the process would fail ("Offset increment outside graph
    capture"). One draw of a single number tells; the generator is then put back where it
    stood, so the caller's random numbers are those it would draw without graphwrap. Where
    the draw fails so, the capture phase is closed by a small capture that succeeds.
    Whether the generator was usable as found."""
    probe = torch.empty(1, device=device)
    state = torch.cuda.get_rng_state(device)  # the probe's draw is given back: the caller's draws stay theirs
    try:
        probe.uniform_()
        torch.cuda.set_rng_state(state, device)
        return True
    except RuntimeError as e:
        if _STUCK not in str(e):
            raise
    logger.warning("the default CUDA generator was left in capture mode on %s; closing it", device)
    _reset_rng_capture_state(device)
    probe.uniform_()
    torch.cuda.set_rng_state(state, device)
    return False


class Pool:
    """A graph memory pool, kept alive by a graph of its own, and the stream its captures run on.

    A private pool lives while some graph captured into it does. Graphs that are dropped (a
    capture that failed verification, a bucket evicted for the memory budget) could take the
    last one with them, and a capture into the pool's handle then fails inside PyTorch's
    allocator. The anchor, a one-kernel graph captured into the pool first, keeps it until the
    engine lets go of it.

    The stream: captures run on a private stream of the pool's own, where no eager work runs,
    so the cuBLAS workspace its graphs' matrix products use is theirs alone (see
    :func:`own_workspace`). It goes back to a free list, for another pool, only once this pool
    and every graph captured into it are gone (each graph record holds its pool): two live
    pools never share a workspace, and the streams (and workspaces) in use stay as few as the
    pools alive at once.
    """

    __slots__ = ("handle", "anchor", "_t", "stream", "recycle", "__weakref__")

    def __init__(self, device: torch.device, fresh: bool = False):
        """``fresh``: a new stream rather than one from the free list, for captures that make no
        matrix product (a free stream's workspace, placed already, is left to the next pool that
        needs one: taken here, that pool would place another)."""
        self.handle = torch.cuda.graph_pool_handle()
        self._t = torch.zeros(1, device=device)
        self.anchor = torch.cuda.CUDAGraph()
        self.stream = private_stream(device) if fresh else _take_capture_stream(device)
        self.recycle = [True]  # False once a capture's workspace landed in this pool
        weakref.finalize(self, _give_back_capture_stream, device, self.stream, self.recycle)
        with CAPTURE_LOCK:
            record(self.anchor, self, device, False, lambda: self._t.add_(1), matmuls=False)


def _take_capture_stream(device: torch.device) -> torch.cuda.Stream:
    with CAPTURE_LOCK:
        free = CAPTURE_STREAMS_FREE.setdefault(device, [])
        return free.pop() if free else private_stream(device)


def _give_back_capture_stream(device: torch.device, stream, recycle) -> None:
    if recycle[0]:
        with CAPTURE_LOCK:
            CAPTURE_STREAMS_FREE.setdefault(device, []).append(stream)


class _WorkspacePool:
    """A private pool that lives as long as the process, for cuBLAS workspaces (one per device)."""

    def __init__(self, device: torch.device):
        self.handle = torch.cuda.graph_pool_handle()
        self.anchor = torch.cuda.CUDAGraph()
        self._t = torch.zeros(1, device=device)
        _record(self.anchor, self.handle, device, False, lambda: self._t.add_(1))


def own_workspace(device: torch.device) -> bool:
    """Make sure the cuBLAS workspace of this thread on the current stream (a pool's capture
    stream) lies in memory that is never given back.

    A captured matrix product keeps the address of the workspace PyTorch keeps per (thread's
    cuBLAS handle, stream). On a stream where eager work runs too, graphs would share it with
    eager matrix products issued there while they replay, each overwriting the other's partial
    results. The only way torch 2.11 offers to drop a workspace, ``_cuda_clearCublasWorkspaces``,
    frees every thread's at once, under matrix products other threads are about to launch
    (wrong results, seen on an H100): graphwrap never calls it. So the first matrix product on
    each capture stream runs in a small capture into a pool of graphwrap's own that lives as
    long as the process: the workspace is allocated there, every later capture on the stream
    reuses it, and no ``empty_cache`` can free memory a graph still writes. If someone else
    clears the workspaces, the next capture allocates one there again. Each (thread, capture
    stream) that captured keeps one workspace (32 MiB on Hopper): memory that stays allocated,
    bounded by the threads that capture and the pools alive at once. The caller holds the
    capture lock and has made the capture stream current. Whether the workspace is placed."""
    cur = torch.cuda.current_stream(device)
    with torch.cuda.stream(side_stream(device)):
        # This thread's cuBLAS handle, made here if need be: outside any capture (creating one
        # inside fails), and on a stream other than the capture stream (asking for the handle
        # sets up its workspace on the current stream, and this one must come from the pool).
        handle = torch.cuda.current_blas_handle()
    placed = (handle, cur.cuda_stream)
    if placed in WORKSPACES_PLACED:
        return True  # one small capture per new pair: each keeps other threads' draws out a moment
    _watch_clears()
    a = torch.ones(16, 16, device=device)
    try:
        wp = WORKSPACE_POOLS.get(device)
        if wp is None:
            wp = WORKSPACE_POOLS[device] = _WorkspacePool(device)
        g = torch.cuda.CUDAGraph()
        # mm takes cuBLAS's workspace, addmm with a bias cuBLASLt's (the same one unless
        # TORCH_CUBLASLT_UNIFIED_WORKSPACE=0)
        _record(g, wp.handle, device, False, lambda: (torch.mm(a, a), torch.addmm(a[0], a, a)))
    except Exception as e:  # noqa: BLE001 - the capture then allocates the workspace in its own pool
        WORKSPACE_POOLS.pop(device, None)  # a pool whose capture failed may refuse further ones
        logger.warning("could not place the cuBLAS workspace of a capture stream in a pool of its own "
                       "(%s: %s); captures on it keep theirs in their own pool", type(e).__name__, first_line(e))
        return False
    WORKSPACES_PLACED.add(placed)
    return True


def _watch_clears():
    """Wrap ``torch._C._cuda_clearCublasWorkspaces`` once, so that a clear by anyone (torch.compile's
    CUDA graphs clear around each recording) makes the next capture on each stream place its
    workspace again."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or getattr(clear, "_graphwrap_watches", False):
        return

    @functools.wraps(clear)
    def cleared(*args, **kwargs):
        WORKSPACES_PLACED.clear()
        return clear(*args, **kwargs)
    setattr(cleared, "_graphwrap_watches", True)  # a mark on a function torch owns
    torch._C._cuda_clearCublasWorkspaces = cleared


def is_invalidated(e: BaseException) -> bool:
    """A capture that failed through no fault of the forward, as far as can be told: invalidated
    from outside (an illegal call elsewhere in the thread, a synchronization of the whole
    device from another thread), or a pool left recording by an earlier failure."""
    text = str(e)
    return any(s in text for s in ("previous error during capture", "already recording", "unjoined"))
