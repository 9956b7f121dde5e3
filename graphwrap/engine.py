"""The engine: input signatures -> buckets -> captured graphs, and the plans that replay them.

A *key* is everything about a call that shapes a graph (input structure, constants, each
tensor's shape without the batch dim, dtype and device, the autocast state). Each key has
buckets, each bucket one or more captured graphs (:class:`~graphwrap.capture.Replica`), and
for every batch size seen a :class:`Plan`: the narrowed input and output views, the output
rebuild and the counters, worked out once, so that a call is a copy, a replay and its outputs.
Keys, buckets and plans are defined in :mod:`graphwrap.plans`; this module makes, captures,
swaps and tunes them.

The loops that drive the engine (``gm(...)`` in :mod:`graphwrap.calls`, :mod:`graphwrap.pipeline`,
:mod:`graphwrap.batcher`) use the methods and attributes without a leading underscore.
"""

import logging
import threading
import time
from typing import Any, Dict, List, Optional

import torch

from . import _compat
from .buckets import BucketTable, padded_rows
from .capture import CaptureFailed, Replica, capture_bucket, copy_graph, device_sync, race
from .compiled import CompiledForward, load_cache, save_cache, static_options, unavailable_reason
from .errors import GraphwrapError
from .outputs import ring_for
from .tree import (
    UnsupportedInput,
    batch_size_of,
    flatten_inputs,
    flatten_outputs,
    map_tensors,
    tensor_meta,
    unflatten_inputs,
)
from .plans import Bucket, Key, Plan, current_stream_id
from .tuning import Tuner, hottest, keep_new, time_replays

logger = logging.getLogger("graphwrap")

Tensor = torch.Tensor
_data_ptr = Tensor.data_ptr

# Bumped by global hooks whenever any module gets a new parameter, buffer or submodule; the
# engine re-reads its module's tensors when it sees a new value.
GENERATION = [0]
_HOOKS_INSTALLED = []
SINGLE_TENSOR_SPEC = flatten_inputs((torch.empty(0),), {})[1]
# Whether each tensor still has the data pointer recorded for it: one C++ loop (CUDA builds).
_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
# Autocast for CUDA on, in one C call with no arguments (the CUDA state on every torch >= 2.1).
autocast_on = torch._C.is_autocast_enabled
grad_on = torch.is_grad_enabled

# A bucket serves its calls eagerly when eager took at most this share of the graph's time.
EAGER_WINS = 0.9
CPU_REASONS = ("CUDA is not available", "the module is not on a CUDA device")


def _bump(*_args):
    GENERATION[0] += 1


def install_hooks():
    if not _HOOKS_INSTALLED:
        for register in _compat.registration_hooks():
            _HOOKS_INSTALLED.append(register(_bump))
        _HOOKS_INSTALLED.append(True)


class _Store:
    """The graphs and their buffers, apart from the engine so a finalizer can release them."""

    def __init__(self):
        self.keys: Dict[Any, Key] = {}
        self.device: Optional[torch.device] = None
        self.pool = None
        # Bumped by release(): a loop holding graphs of an older epoch drops them.
        self.epoch = 0

    def release(self):
        if self.keys and self.device is not None and torch.cuda.is_initialized():
            # A replay may still be running: its memory must not be handed out before it ends.
            device_sync(self.device)
        self.keys.clear()
        self.pool = None
        self.epoch += 1


def release_store(store: _Store):
    try:
        store.release()
    except Exception:  # noqa: BLE001 - never raise from a finalizer (interpreter shutdown)
        pass


def describe_key(in_spec, meta, autocast) -> str:
    spec_args, spec_kw = in_spec
    it = iter(meta)

    def one(spec):
        tag = spec[0]
        if tag == "T":
            shape, dtype, device = next(it)
            dims = ", ".join(str(d) for d in shape)
            return f"Tensor[B{', ' if dims else ''}{dims}] {str(dtype).replace('torch.', '')} {device}"
        if tag == "C":
            return repr(spec[2])
        if tag in ("tuple", "list"):
            inner = ", ".join(one(s) for s in spec[1])
            return f"({inner})" if tag == "tuple" else f"[{inner}]"
        if tag in ("dict", "defaultdict"):
            inner = "{" + ", ".join(f"{k!r}: {one(s)}" for k, s in zip(spec[2], spec[3])) + "}"
            return inner if spec[1] is dict else f"{spec[1].__name__}({inner})"
        return f"{spec[1].__name__}(" + ", ".join(one(s) for s in spec[2]) + ")"

    parts = [one(s) for s in spec_args] + [f"{k}={one(s)}" for k, s in spec_kw]
    text = "(" + ", ".join(parts) + ")"
    if autocast is not None:
        text += f" autocast={str(autocast).replace('torch.', '')}"
    return text


class Engine:
    """Captures and replays one module's graphs; shared by every loop that drives it.

    Public to the loops: :meth:`prepare`, :meth:`fast_plan`, :meth:`plan`, :meth:`plan_for_rows`,
    :meth:`eager`, :meth:`eager_plan`, :meth:`order_stream`, :meth:`lease`, :meth:`give_back`,
    :meth:`join_info`, :meth:`copy_stream`, and the attributes ``lock``, ``epoch``, ``table``,
    ``batch_dim``, ``clone``, ``module``.
    """

    def __init__(self, module, *, table: BucketTable, adaptive, policy, compile_opts, max_pool_bytes,
                 batch_dim, warmup_iters, clone, fallback, verify, max_keys, eager_if_faster):
        install_hooks()
        self.module = module
        self.table = table
        self.adaptive = adaptive  # counting batch sizes before the buckets are fitted, else None
        self.policy = policy
        self.compile_opts = compile_opts
        self.compiled: Optional[CompiledForward] = None  # made at the first capture
        self.compile_off: Optional[str] = None  # why compile= was given up, if it was
        self.max_pool_bytes = max_pool_bytes
        self.batch_dim = batch_dim
        self.warmup_iters = warmup_iters
        self.clone = clone
        self.fallback = fallback
        self.verify = verify
        self.max_keys = max_keys
        self.eager_if_faster = eager_if_faster
        self.lock = threading.RLock()
        self.store = _Store()
        self.epoch = 0  # bumped by reset(): plans and leases of an older epoch are dropped
        self.eager_counts: Dict[str, int] = {}  # reason -> calls
        self.logged = set()
        self.last_stream = None
        self.last_sid = None
        self.gen = -1
        self.tensors: List[Tensor] = []
        self.ptrs = None  # data pointers of the module's tensors when the graphs were captured
        self.ptr_list = None
        self.ptr_idx = None
        self.keepalive = None
        self.device: Optional[torch.device] = None
        self.fast: Dict[torch.Size, Plan] = {}  # full input shape -> plan, for gm(x) with one tensor
        self.eager_keys: Dict[Any, Key] = {}  # keys that run eagerly for want of CUDA (the batcher's)
        self._copy_streams: Dict[torch.device, torch.cuda.Stream] = {}
        self.background: Optional[threading.Thread] = None  # capture(..., background=True)
        self.background_state: Optional[str] = None
        self.background_error: Optional[str] = None
        self.static_forward: Optional[CompiledForward] = None  # the tuner's per-size compile
        self.tuner = Tuner(self)

    # ------------------------------------------------------------------ per-call checks

    def weights_unmoved(self) -> bool:
        """Whether every parameter and buffer is where it was when the graphs were captured."""
        if _ptrs_equal is not None:
            return _ptrs_equal(self.tensors, self.ptr_list, self.ptr_idx)
        return tuple(map(_data_ptr, self.tensors)) == self.ptrs

    def fast_plan(self, x: Tensor) -> Optional[Plan]:
        """The plan for ``gm(x)`` with one tensor, if every per-call check passes; else None
        (the caller takes the general path, which says why or builds the plan)."""
        plan = self.fast.get(x.shape)
        if (plan is None or plan.dtype is not x.dtype or plan.dev != x.get_device()
                or self.module.training or GENERATION[0] != self.gen or not self.weights_unmoved()
                or autocast_on() or (x.requires_grad and grad_on())):
            return None
        return plan

    def prepare(self, args, kwargs):
        """The graph key and call facts ``(key, (leaves, n, spec, meta, autocast, device))``, or a
        string saying why this call runs eagerly."""
        module = self.module
        if module.training:
            return "the module is in training mode"
        if GENERATION[0] != self.gen:
            self._refresh_tensors()
        if self.ptrs is not None and not self.weights_unmoved():
            self._tensors_moved()
        if not kwargs and len(args) == 1 and type(args[0]) is Tensor:
            leaves = [args[0]]
            spec = SINGLE_TENSOR_SPEC
        else:
            try:
                leaves, spec = flatten_inputs(args, kwargs)
            except UnsupportedInput as e:
                return str(e)
        if not leaves:
            return "the call has no tensor inputs to batch"
        device = self.device or self._find_device(leaves)
        if device is None:
            return CPU_REASONS[1] if _compat.cuda_available() else CPU_REASONS[0]
        if grad_on():
            for t in leaves:
                if t.requires_grad:
                    return "an input requires grad and grad mode is on"
        bd = self.batch_dim
        n = batch_size_of(leaves, bd)
        if n == 0:
            return "the batch is empty"
        if self.adaptive is not None:
            return self._observe(n)
        meta = tensor_meta(leaves, bd)
        autocast = _compat.autocast_state("cuda")
        return (spec, meta, autocast), (leaves, n, spec, meta, autocast, device)

    def _observe(self, n: int) -> str:
        """Count a batch size for the Adaptive policy; the call runs eagerly."""
        with self.lock:
            adaptive = self.adaptive
            if adaptive is not None:
                buckets = adaptive.observe(n)
                if buckets is not None:
                    self.table = BucketTable(buckets)
                    self.adaptive = None
                    hist = adaptive.histogram
                    rows = sum(k * v for k, v in hist.items())
                    pad = padded_rows(buckets, hist)
                    logger.info("graphwrap: adaptive buckets %s from %d calls; %.1f%% of their rows would be padding",
                                buckets, adaptive.seen, 100.0 * pad / (rows + pad))
        return f"adaptive buckets: counting batch sizes over the first {self.policy.warmup_calls} calls"

    def _find_device(self, leaves):
        module = self.module
        t = next(iter(module.parameters()), None)
        if t is None:
            t = next(iter(module.buffers()), None)
        if t is None:
            # A module with no tensors of its own runs where its inputs are, call by call.
            t = next((x for x in leaves if x.is_cuda), None)
            return None if t is None else t.device
        if not t.is_cuda:
            return None
        self.device = t.device
        return t.device

    def _refresh_tensors(self):
        module = self.module
        self.tensors = list(module.parameters()) + list(module.buffers())
        self.gen = GENERATION[0]
        self.device = None
        if self.ptrs is not None and (len(self.tensors) != len(self.ptrs) or not self.weights_unmoved()):
            self._tensors_moved()

    def _tensors_moved(self):
        self.log_once("moved", logging.INFO,
                      "graphwrap: the module's parameters or buffers were replaced or moved; "
                      "dropping its graphs, they are captured again on the next calls")
        self.reset()
        self._refresh_tensors()

    def _record_ptrs(self):
        self._refresh_tensors()
        self.keepalive = list(self.tensors)  # never replay on freed memory
        self.ptr_list = [t.data_ptr() for t in self.tensors]
        self.ptrs = tuple(self.ptr_list)
        self.ptr_idx = list(range(len(self.tensors)))

    def reset(self):
        """Drop every graph and static buffer; the next calls capture again."""
        with self.lock:
            self.store.release()
            self.epoch = self.store.epoch
            self.fast.clear()
            self.ptrs = self.ptr_list = self.ptr_idx = None
            self.keepalive = None
            self.last_stream = self.last_sid = None
            self.device = None
            self.gen = -1

    # ------------------------------------------------------------------ keys and plans

    def key_for(self, key, spec, meta, autocast, device, leaves) -> Optional[Key]:
        """The key of these call facts, made on first use; None past ``max_keys``."""
        store = self.store
        ks = store.keys.get(key)
        if ks is not None:
            return ks
        if len(store.keys) >= self.max_keys:
            return None
        for i, t in enumerate(leaves):
            if t.is_cuda and t.device != device:
                raise GraphwrapError(
                    f"input tensor #{i} is on {t.device} but the module is on {device}; move it with "
                    f".to({str(device)!r}) (CPU tensors are copied over for you)"
                )
        if store.device is None:
            store.device = device
        elif store.device != device:
            self.reset()
            store.device = device
        single = None
        if spec is SINGLE_TENSOR_SPEC and autocast is None:
            single = (meta[0][1], -1 if meta[0][2].type == "cpu" else meta[0][2].index)
        ks = Key(describe_key(spec, meta, autocast), spec, device, autocast,
                 describe_key(spec, tuple((shape, dtype, device) for shape, dtype, _ in meta), autocast), single)
        store.keys[key] = ks
        return ks

    def plan(self, prep):
        """The plan of a prepared call of at most the largest bucket, captured as needed; or a
        string saying why the call runs eagerly. Takes the lock."""
        key, (leaves, n, spec, meta, autocast, device) = prep
        with self.lock:
            ks = self.store.keys.get(key)
            if ks is None:
                ks = self.key_for(key, spec, meta, autocast, device, leaves)
                if ks is None:
                    return f"more than max_keys={self.max_keys} input signatures"
            if ks.failed is not None:
                ks.eager_calls += 1
                return ks.failed
            plan = ks.plans.get(n) or self._make_plan(ks, n, leaves, n)
            if ks.single is not None and type(plan) is Plan and ks.plans.get(n) is plan:  # kept plans only
                self.fast[leaves[0].shape] = plan
            return plan

    def plan_for_rows(self, ks: Key, rows: int, leaves, n: int):
        """The plan for ``rows`` rows of key ``ks`` (a chunk of a larger batch); the caller holds
        the lock. A string if the key failed."""
        if ks.failed is not None:
            return ks.failed
        return ks.plans.get(rows) or self._make_plan(ks, rows, leaves, n)

    def key_of(self, prep) -> Optional[Key]:
        """The key of a prepared call (made on first use), or None past ``max_keys``. Takes the lock."""
        key, (leaves, n, spec, meta, autocast, device) = prep
        with self.lock:
            return self.store.keys.get(key) or self.key_for(key, spec, meta, autocast, device, leaves)

    def _make_plan(self, ks: Key, rows: int, leaves, n: int):
        size = self.table.size_for(rows)
        b = ks.buckets.get(size)
        if b is None or (not b.replicas and not b.failed):
            if ks.warming and size <= self.table.max:
                # The background thread captures this bucket: eager now, not kept.
                ks.warming_calls += 1
                return Plan(self, ks, rows, b or Bucket(size), reason=None, eager=True)
            b = self._capture(ks, size, leaves, n)
            if ks.failed is not None:
                return ks.failed
        if b.failed is not None and size > self.table.max:
            # A large bucket that could not be captured (memory): the caller chunks or runs eagerly.
            return Plan(self, ks, rows, b, reason=b.failed)
        if b.failed is not None and b.over_budget:
            larger = self._larger_captured(ks, size)
            if larger is None:
                # Not kept: a larger bucket captured later (capture()) serves these batches.
                return Plan(self, ks, rows, b, reason=b.failed)
            b = larger
        plan = ks.plans[rows] = Plan(self, ks, rows, b, reason=b.failed)
        return plan

    def _fail_key(self, ks: Key, reason: str):
        ks.failed = reason
        ks.join = None
        ks.join_refused = reason
        for shape, p in list(self.fast.items()):
            if p.key is ks:
                del self.fast[shape]
        ks.plans.clear()

    def _larger_captured(self, ks: Key, size: int) -> Optional[Bucket]:
        for s in self.table.buckets:
            if s > size:
                b = ks.buckets.get(s)
                if b is not None and b.replicas and b.failed is None:
                    return b
        if self.fallback == "raise":
            raise GraphwrapError(
                f"bucket {size} of {ks.label} is over max_pool_bytes and no larger bucket is captured; "
                "raise max_pool_bytes, call capture() first (it takes the largest buckets first) or pass "
                'fallback="eager"'
            )
        return None

    # ------------------------------------------------------------------ capture

    def capture_all(self, prep) -> dict:
        """Capture every bucket of this call's key, largest first; its stats."""
        key, (leaves, n, spec, meta, autocast, device) = prep
        with self.lock:
            ks = self.key_for(key, spec, meta, autocast, device, leaves)
            if ks is None:
                raise GraphwrapError(
                    f"cannot capture: this GraphedModule already holds max_keys={self.max_keys} "
                    "input signatures; pass a larger max_keys= or call reset()"
                )
            t0 = time.perf_counter()
            for size in sorted(self.table.buckets, reverse=True):
                if ks.failed:
                    break
                b = ks.buckets.get(size)
                if b is None or (not b.replicas and not b.failed):
                    self._capture(ks, size, leaves, n)
            logger.info("graphwrap: captured %d buckets of %s in %.2f s", len(ks.buckets), ks.label,
                        time.perf_counter() - t0)
            if self.compile_opts is not None and self.compile_opts.get("cache") and self.compiled is not None:
                save_cache(self.compile_opts["cache"])
            return self.key_stats(ks)

    def _capture(self, ks: Key, size: int, leaves, n: int, plain: bool = False) -> Bucket:
        """Capture bucket ``size`` of ``ks`` (the caller holds the lock); the bucket, failed or not."""
        b, args = self._capture_args(ks, size, leaves, n, plain)
        with torch.cuda.device(ks.device):
            try:
                rep, info = capture_bucket(**args)
            except CaptureFailed as e:
                return self._capture_error(ks, b, e, lambda: self._capture(ks, size, leaves, n))
            self._install(ks, b, rep, info, args["compiled"])
        return b

    def _capture_args(self, ks: Key, size: int, leaves, n: int, plain: bool = False, sample=None, forward=None):
        """The bucket (made if new) and capture_bucket's arguments; the caller holds the lock."""
        b = ks.buckets.get(size)
        if b is None:
            b = ks.buckets[size] = Bucket(size)
        store = self.store
        device = ks.device
        bd = self.batch_dim
        with torch.cuda.device(device):
            if store.pool is None:
                store.pool = torch.cuda.graph_pool_handle()
            if self.ptrs is None:
                self._record_ptrs()
            if sample is None:
                m = min(n, size)
                sample = [t.narrow(bd, 0, m).to(device) for t in leaves]
            budget = self._budget_left()
            if size > self.table.max:
                budget = self._large_budget(device, budget)
        compiled = forward if forward is not None else None if plain else self._compiled_forward()
        return b, dict(module=self.module, device=device, pool=store.pool, in_spec=ks.in_spec, sample=sample,
                       size=size, batch_dim=bd, warmup_iters=self.warmup_iters, autocast_dtype=ks.autocast,
                       verify=self.verify, kinds=ks.kinds, out_spec=ks.out_spec, compiled=compiled,
                       budget_left=budget)

    def _capture_error(self, ks: Key, b: Bucket, e: CaptureFailed, plain_again) -> Bucket:
        """A failed capture: a failed compile captures the plain forward (``plain_again()``),
        anything else is recorded. The caller holds the lock."""
        if e.scope == "compile":
            if e.pool_lost:
                self.store.pool = None
            self._give_up_compile(e.reason)
            return plain_again()
        self._capture_failed(ks, b, e)
        return b

    def _install(self, ks: Key, b: Bucket, rep: Replica, info: dict, compiled):
        """A captured graph joins its bucket (timed against eager first); the caller holds the lock."""
        ks.kinds, ks.out_spec = info["kinds"], info["out_spec"]
        self._add_replica(ks, b, rep, info, compiled)
        if b.compiled and b.kernels == "shared" and self.compile_opts.get("static") == "auto":
            self.tuner.start()
        race_note = ""
        if self.eager_if_faster:
            with torch.cuda.device(ks.device):
                race_note = self._race(ks, b, rep)
        if compiled is not None:
            how = (f"compiled, {info['compiled_graphs']} graphs in {info['compile_s']:.2f} s" if b.compiled
                   else "NOT compiled: torch.compile compiled nothing for this shape")
            level = logging.INFO if b.compiled else logging.WARNING
        else:
            how, level = "plain forward", logging.INFO
        logger.log(level, "graphwrap: captured bucket %d of %s in %.1f ms (%s; verify %.1f ms), graph pool +%.1f MiB%s",
                   b.size, ks.label, 1e3 * info["capture_s"], how, 1e3 * info["verify_s"],
                   info["pool_bytes"] / 2**20, race_note)

    # ------------------------------------------------------------------ capture in the background

    def capture_background(self, prep):
        """Capture (and compile) every bucket of this call's key on a thread of its own."""
        key, (leaves, n, spec, meta, autocast, device) = prep
        with self.lock:
            if self.background is not None and self.background.is_alive():
                raise GraphwrapError("a background capture is already running; call wait() first")
            ks = self.key_for(key, spec, meta, autocast, device, leaves)
            if ks is None:
                raise GraphwrapError(f"cannot capture: this GraphedModule already holds max_keys={self.max_keys} "
                                     "input signatures; pass a larger max_keys= or call reset()")
            ks.warming = True
            sample = [t.to(device) for t in leaves]
            self.background_state = "capturing the plain forward"
            self.background = threading.Thread(target=self._background, args=(ks, sample, n),
                                               name="graphwrap-capture", daemon=True)
            self.background.start()

    def wait_background(self, timeout: Optional[float] = None) -> bool:
        """Wait for the background capture, then for the per-size kernels of the hot buckets."""
        end = None if timeout is None else time.monotonic() + timeout
        t = self.background
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                return False
        left = None if end is None else max(0.0, end - time.monotonic())
        return self.tuner.wait(self.tune_pending, left)

    def _background(self, ks: Key, sample, n: int):
        t0 = time.perf_counter()
        sizes = sorted(self.table.buckets, reverse=True)
        stream = torch.cuda.Stream(ks.device)
        try:
            with torch.cuda.device(ks.device), torch.cuda.stream(stream):
                for size in sizes:  # plain graphs first: calls are served by replays from now on
                    self._capture_unlocked(ks, size, sample, n, plain=True)
                ks.warming = False
                if self.compile_opts is None or self.compile_off is not None:
                    return
                self.background_state = "compiling"
                with self.lock:
                    cf = self._compiled_forward()
                if cf is None:
                    return
                self.background_state = "replacing plain graphs by compiled ones"
                for size in sizes:
                    b = ks.buckets.get(size)
                    if b is not None and b.replicas and not b.compiled and ks.failed is None:
                        self._recapture_compiled(ks, b, n)
                if self.compile_opts.get("cache"):
                    save_cache(self.compile_opts["cache"])
            logger.info("graphwrap: background capture of %s done in %.1f s", ks.label, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - reported; calls go on with what was captured
            logger.warning("graphwrap: background capture of %s stopped: %s: %s", ks.label, type(e).__name__, e)
            self.background_error = f"{type(e).__name__}: {e}"
        finally:
            ks.warming = False
            self.background_state = "done"
            stream.synchronize()

    def _capture_unlocked(self, ks: Key, size: int, sample, n: int, plain: bool, into: Optional[Bucket] = None,
                          forward=None):
        """Capture outside the engine's lock (calls go on meanwhile), install under it. Returns
        the bucket the graph went into, or None. ``forward``: the tuner's per-size compile,
        whose failure is logged and leaves the bucket as it is."""
        with self.lock:
            if ks.failed is not None or self.store.keys.get(self._key_tuple(ks)) is not ks:
                return None  # failed or reset meanwhile
            b = ks.buckets.get(size)
            if into is None and b is not None and (b.replicas or b.failed):
                return None
            b, args = self._capture_args(ks, size, None, n, plain, sample=[
                t.narrow(self.batch_dim, 0, min(n, size)) for t in sample], forward=forward)
            args["replay_lock"] = self.lock  # its verification replays wait for the other replays
            epoch = self.epoch
        try:
            rep, info = capture_bucket(**args)
        except CaptureFailed as e:
            with self.lock:
                if forward is not None:
                    if e.pool_lost:
                        self.store.pool = None
                    logger.warning("graphwrap: per-size kernels for bucket %d of %s not captured (%s); it keeps the "
                                   "shared kernels", size, ks.label, e.reason)
                elif self.epoch == epoch and into is None:
                    self._capture_error(ks, b, e, lambda: self._capture(ks, size, sample, n, plain=True))
                elif e.scope == "compile":
                    self._give_up_compile(e.reason)
            return None
        with self.lock:
            if self.epoch != epoch:
                return None
            target = b if into is None else into
            self._install(ks, target, rep, info, args["compiled"])
            return target

    def _recapture_compiled(self, ks: Key, old: Bucket, n: int):
        """Replace a bucket's plain graph by one of the compiled kernels; its plans are rebuilt
        on the next call (loops holding the old graphs go on replaying them)."""
        new = Bucket(old.size)
        sample = [t.clone() for t in old.replicas[0].static_inputs]
        got = self._capture_unlocked(ks, old.size, sample, old.size, plain=False, into=new)
        if got is None:
            return
        with self.lock:
            self._swap_bucket(ks, old, new)

    def _swap_bucket(self, ks: Key, old: Bucket, new: Bucket):
        """``new`` serves ``old``'s batches from the next call, with its counts; plans are rebuilt
        (loops holding the old graphs go on replaying them). The caller holds the lock."""
        counts = self.key_stats(ks)["buckets"][old.size]
        # The old graphs' memory stays in the pool (for later captures): still counted here.
        new.pool_bytes += old.pool_bytes
        new.capture_s += old.capture_s
        new.compile_s += old.compile_s
        new.replays, new.rows = counts["replays"], counts["rows"]
        new.padded_rows, new.eager_calls = counts["padded_rows"], counts["eager_calls"]
        for m, plan in list(ks.plans.items()):
            if plan.bucket is old:
                del ks.plans[m]
        for shape, plan in list(self.fast.items()):
            if plan.bucket is old:
                del self.fast[shape]
        ks.buckets[old.size] = new

    # ------------------------------------------------------------------ per-size kernels (tuning)

    def _tune_candidates(self):
        """``(rows, calls, (key, bucket))`` of each bucket that runs shared compiled kernels and
        was not tuned yet; the caller holds the lock."""
        out = []
        for ks in self.store.keys.values():
            if ks.failed is not None:
                continue
            counts = None
            for b in ks.buckets.values():
                if (b.replicas and b.compiled and b.kernels == "shared" and not b.tuned and b.failed is None
                        and b.serves == "graph"):
                    counts = counts or self.key_stats(ks)["buckets"]
                    c = counts[b.size]
                    out.append((c["rows"], c["replays"], (ks, b)))
        return out

    def tune_pending(self) -> bool:
        """Whether a hot bucket waits for its per-size kernels."""
        with self.lock:
            return (self.compile_off is None and self.compile_opts is not None
                    and hottest(self._tune_candidates()) is not None)

    def tune_next(self) -> str:
        """Tune the hottest untuned bucket (the tuner thread's step): "tuned", "waiting" (buckets
        left, none hot yet) or "done"."""
        with self.lock:
            if self.compile_opts is None or self.compile_off is not None:
                return "done"
            candidates = self._tune_candidates()
            if not candidates:
                return "done"
            job = hottest(candidates)
            if job is None:
                return "waiting"
            ks, old = job
            old.tuned = True  # once, whatever comes of it
            if self.static_forward is None:
                self.static_forward = CompiledForward(self.module, static_options(self.compile_opts))
            forward, epoch, device = self.static_forward, self.epoch, ks.device
        stream = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            self._tune(ks, old, forward, epoch)
        stream.synchronize()
        return "tuned"

    def _tune(self, ks: Key, old: Bucket, forward: CompiledForward, epoch: int):
        t0 = time.perf_counter()
        with self.lock:
            self.order_stream(ks.device)  # the sample is read after the last call's work
            sample = [t.clone() for t in old.replicas[0].static_inputs]
        new = Bucket(old.size)
        new.tuned = True
        if self._capture_unlocked(ks, old.size, sample, old.size, plain=False, into=new, forward=forward) is None:
            return
        with self.lock:
            if self.epoch != epoch or ks.buckets.get(old.size) is not old or ks.failed is not None:
                return
            if not new.compiled:
                logger.warning("graphwrap: per-size kernels for bucket %d of %s: torch.compile compiled nothing; "
                               "it keeps the shared kernels", old.size, ks.label)
                return
            # The shared kernels timed on a graph of their own: replica 0 serves gm(...), and
            # replaying it here would overwrite outputs a caller may hold (outputs="view").
            if not self._capture_replica(ks, old):
                return
            extra = old.replicas.pop()  # never leased: the lock is held until it is dropped
            self.order_stream(ks.device)
            shared_s, per_size_s = time_replays(extra.graph.replay, new.replicas[0].graph.replay)
            del extra
            for b in (old, new):
                b.shared_us, b.per_size_us = 1e6 * shared_s, 1e6 * per_size_s
            kept = keep_new(shared_s, per_size_s)
            if kept:
                self._swap_bucket(ks, old, new)
            logger.info("graphwrap: bucket %d of %s: per-size kernels replay in %.1f us, the shared ones in %.1f us; "
                        "keeps the %s (tuned in %.1f s)", old.size, ks.label, 1e6 * per_size_s, 1e6 * shared_s,
                        "per-size kernels" if kept else "shared kernels", time.perf_counter() - t0)
        if kept and self.compile_opts.get("cache"):
            save_cache(self.compile_opts["cache"])

    def _key_tuple(self, ks: Key):
        for k, v in self.store.keys.items():
            if v is ks:
                return k
        return None

    def _race(self, ks: Key, b: Bucket, rep: Replica) -> str:
        """Time this bucket's graph against eager; serve it eagerly if eager is faster."""
        def eager_call(leaves):
            args, kwargs = unflatten_inputs(ks.in_spec, leaves)
            with _compat.autocast_without_cache(ks.autocast):
                return self.module(*args, **kwargs)

        graph_s, eager_s = race(rep, eager_call, self.clone)
        b.graph_us, b.eager_us = 1e6 * graph_s, 1e6 * eager_s
        if eager_s <= EAGER_WINS * graph_s:
            b.serves = "eager"
            logger.info("graphwrap: bucket %d of %s runs eagerly: eager took %.1f us a call, the graph %.1f us",
                        b.size, ks.label, b.eager_us, b.graph_us)
            return f"; serves eagerly (eager {b.eager_us:.1f} us, graph {b.graph_us:.1f} us a call)"
        return f"; graph {b.graph_us:.1f} us, eager {b.eager_us:.1f} us a call"

    def _copy_graph(self, label: str, size: int, device, dsts, srcs):
        """An output ring's fill (see :func:`copy_graph`); the caller holds the lock. A failure
        is logged, and the ring clones from then on."""
        try:
            return copy_graph(device, self.store.pool, dsts, srcs)
        except CaptureFailed as e:
            if e.pool_lost:
                self.store.pool = torch.cuda.graph_pool_handle()
            self.log_once(("ring", label, size), logging.WARNING,
                          f"graphwrap: outputs of bucket {size} of {label} are cloned from now on: {e.reason}")
            raise

    def _add_replica(self, ks: Key, b: Bucket, rep: Replica, info: dict, compiled):
        if info.get("pool") is not None:
            self.store.pool = info["pool"]  # captured again in a new pool (see capture_bucket)
        if self.clone:
            device = ks.device
            # The fill names its bucket by label and size only: holding the Key or the Bucket
            # would make a cycle (bucket -> graph -> ring -> fill -> bucket) that keeps the
            # graphs and their memory after the module is deleted, until a garbage collection.
            label, size = ks.label, b.size
            rep.ring = ring_for(rep.static_outputs, rep.kinds, self.batch_dim,
                                lambda dsts, srcs: self._copy_graph(label, size, device, dsts, srcs))
        b.replicas.append(rep)
        b.capture_s += info["capture_s"]
        b.verify_s += info["verify_s"]
        b.pool_bytes += info["pool_bytes"]
        b.pool_estimate = max(b.pool_estimate, info["pool_estimate"])
        b.compile_s += info["compile_s"]
        b.compiled_graphs += info["compiled_graphs"]
        b.forward = compiled
        if compiled is None:
            b.compiled = False if self.compile_opts is not None else None
            return
        b.kernels = "shared" if compiled.dynamic else "per-size"
        # Compiled kernels ran if this warm-up compiled a graph, or this shape (any shape, with
        # dynamic shapes) was compiled before, by this key or one whose static inputs look the
        # same (dynamo's cache outlives reset()): otherwise dynamo ran the forward uncompiled.
        seen = compiled.shapes
        ran = (info["compiled_graphs"] > 0 or (ks.seen_as, b.size) in seen
               or (compiled.dynamic and any(label == ks.seen_as for label, _ in seen)))
        if ran:
            seen.add((ks.seen_as, b.size))
        b.compiled = ran if b.compiled is None else (b.compiled and ran)

    def _compiled_forward(self) -> Optional[CompiledForward]:
        """The compiled forward to capture, or None for the plain one."""
        opts = self.compile_opts
        if opts is None or self.compile_off is not None:
            return None
        cf = self.compiled
        if cf is None:
            reason = unavailable_reason()
            if reason is not None:
                self._give_up_compile(reason)
                return None
            if opts.get("cache"):
                load_cache(opts["cache"])
            cf = self.compiled = CompiledForward(self.module, opts)
        return cf

    def _give_up_compile(self, reason: str):
        self.compile_off = reason
        msg = f"graphwrap: compile= given up ({reason}); capturing the plain forward"
        if self.fallback == "raise":
            raise GraphwrapError(f"{msg}. Pass fallback=\"eager\" to accept the plain forward")
        self.log_once(("compile",), logging.WARNING, msg)

    @staticmethod
    def _large_budget(device, budget: Optional[int]) -> int:
        """Pool growth allowed for a bucket above the largest: at most half the device memory
        that is free or cached unused, and within ``max_pool_bytes``."""
        free = torch.cuda.mem_get_info(device)[0]
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free // 2 if budget is None else min(budget, free // 2)

    def _budget_left(self) -> Optional[int]:
        budget = self.max_pool_bytes
        if budget is None:
            return None
        return budget - sum(b.pool_bytes for ks in self.store.keys.values() for b in ks.buckets.values())

    def _capture_failed(self, ks: Key, b: Bucket, e: CaptureFailed):
        if e.pool_lost:
            self.store.pool = None  # graphs already in it keep their memory; new ones get a new pool
        if e.scope == "budget":
            b.failed = e.reason
            b.over_budget = True
            b.pool_estimate = e.pool_estimate
            where = ("are chunked or run eagerly" if b.size > self.table.max
                     else "go to the next larger captured bucket")
            self.log_once(("budget", ks.label, b.size), logging.INFO,
                          f"graphwrap: bucket {b.size} of {ks.label} not captured: {e.reason}; its batches {where}")
            return
        if e.scope == "bucket":
            b.failed = e.reason
            torch.cuda.empty_cache()
        else:
            self._fail_key(ks, e.reason)
        msg = f"graphwrap: capture of bucket {b.size} for {ks.label} failed: {e.reason}"
        if self.fallback == "raise":
            err = GraphwrapError(f"{msg}. Pass fallback=\"eager\" to run such inputs eagerly instead")
            raise err from (e.cause or e)
        self.log_once(("capture", ks.label, b.size if e.scope == "bucket" else None), logging.WARNING,
                      f"{msg}; running {'this bucket' if e.scope == 'bucket' else 'these inputs'} eagerly")

    # ------------------------------------------------------------------ leases (pipeline)

    def lease(self, prep, count: int):
        """``count`` graphs of the bucket of a prepared call, for one loop's sole use (captured as
        needed): ``(key, bucket, replicas)``, or None where ``gm(...)`` must serve the call (eager,
        a failed capture, a bucket that serves eagerly, a batch above the largest bucket). The
        caller holds the lock."""
        key, (leaves, n, spec, meta, autocast, device) = prep
        ks = self.store.keys.get(key) or self.key_for(key, spec, meta, autocast, device, leaves)
        if ks is None or ks.failed is not None:
            return None
        size = self.table.size_for(n)
        b = ks.buckets.get(size)
        if b is None or (not b.replicas and not b.failed):
            b = self._capture(ks, size, leaves, n)
        if b.failed is not None or ks.failed is not None or b.serves == "eager":
            return None
        taken = []
        for i in range(1, len(b.replicas)):
            if len(taken) == count:
                break
            if i not in b.leased:
                taken.append(i)
        while len(taken) < count:
            if not self._capture_replica(ks, b):
                return None
            taken.append(len(b.replicas) - 1)
        b.leased.update(taken)
        return ks, b, [b.replicas[i] for i in taken]

    def give_back(self, replicas):
        """Return leased graphs (the caller holds the lock)."""
        for ks in self.store.keys.values():
            for b in ks.buckets.values():
                for i, r in enumerate(b.replicas):
                    if any(r is x for x in replicas):
                        b.leased.discard(i)

    def _capture_replica(self, ks: Key, b: Bucket) -> bool:
        """One more graph of a captured bucket, with the first graph's static inputs as sample."""
        store = self.store
        first = b.replicas[0]
        compiled = b.forward if b.compiled else None
        with torch.cuda.device(ks.device):
            if store.pool is None:
                store.pool = torch.cuda.graph_pool_handle()
            try:
                rep, info = capture_bucket(
                    module=self.module, device=ks.device, pool=store.pool,
                    in_spec=ks.in_spec, sample=first.static_inputs, size=b.size,
                    batch_dim=self.batch_dim, warmup_iters=1, autocast_dtype=ks.autocast,
                    verify=self.verify, kinds=ks.kinds, out_spec=ks.out_spec,
                    compiled=compiled, budget_left=self._budget_left(),
                )
            except CaptureFailed as e:
                if e.scope == "budget":  # the loop runs this bucket through gm(...) instead
                    return False
                if e.scope == "compile" and e.pool_lost:
                    store.pool = None
                if e.scope != "compile":
                    self._capture_failed(ks, b, e)
                return False
        self._add_replica(ks, b, rep, info, compiled)
        return True

    # ------------------------------------------------------------------ streams

    def order_stream(self, device):
        """The caller's current stream, made to wait for the last call's work if it is another.

        The static buffers and the pool are shared by every caller: work issued on another
        stream (another thread's, say) must not touch them before the last call's work is done.
        """
        last = self.last_stream
        if current_stream_id is not None and last is not None:
            # (stream id, device index, device type): one C call, no Stream object built.
            if current_stream_id(device.index) == self.last_sid:
                return last
        cur = torch.cuda.current_stream(device)
        if last is not None and last != cur:
            cur.wait_stream(last)
        self.last_stream = cur
        self.last_sid = current_stream_id(device.index) if current_stream_id is not None else None
        return cur

    def copy_stream(self, device) -> torch.cuda.Stream:
        """A stream of the engine's own on ``device`` for host-to-device copies."""
        s = self._copy_streams.get(device)
        if s is None:
            s = self._copy_streams[device] = torch.cuda.Stream(device)
        return s

    # ------------------------------------------------------------------ eager

    def eager_run(self, args, kwargs):
        """The module run eagerly, with CPU inputs moved to its device."""
        device = self.device
        if device is not None:
            try:
                args, kwargs = map_tensors(lambda t: t.to(device) if t.device.type == "cpu" else t, (args, kwargs))
            except GraphwrapError:
                pass  # inputs in a container that cannot be rebuilt: the module gets them as given
        return self.module(*args, **kwargs)

    def eager(self, args, kwargs, reason: str):
        """Run eagerly for ``reason``: counted in ``stats()["eager_calls"]``, logged once."""
        counts = self.eager_counts
        counts[reason] = counts.get(reason, 0) + 1
        if counts[reason] == 1:
            level = logging.INFO if reason.startswith(("the module", "CUDA")) else logging.WARNING
            self.log_once(("eager", reason), level, f"graphwrap: running eagerly: {reason}")
        return self.eager_run(args, kwargs)

    def eager_plan(self, plan: Plan, args, kwargs):
        """A call whose plan runs eagerly: by choice (eager measured faster; its outputs, like a
        graph's, never require grad) or for a reason (the module's own call)."""
        plan.calls += 1
        if plan.reason is not None:
            return self.eager(args, kwargs, plan.reason)
        with torch.no_grad():
            return self.eager_run(args, kwargs)

    def log_once(self, tag, level, msg):
        logged = self.logged
        if tag not in logged:
            logged.add(tag)
            logger.log(level, msg)

    # ------------------------------------------------------------------ joining requests (batcher)

    def join_info(self, args, kwargs):
        """How the batcher may join a request with others: ``(group, leaves, n, key)``, where
        requests of one ``group`` (the key itself) have the same input signature and may go into
        one call, and ``key.join`` says whether joining was shown to give each request what it gets alone
        (None: not shown yet); or a string saying why this request runs alone.

        A signature that runs eagerly for want of CUDA gets a key of its own here, so the
        batcher works the same way on a machine without a GPU; one that runs eagerly for any
        other reason (capture failed, rows mix, training mode, ...) is never joined.
        """
        if not kwargs and len(args) == 1 and type(args[0]) is Tensor:
            plan = self.fast_plan(args[0])  # a shape seen before: no flattening, no key to build
            if plan is not None:
                ks = plan.key
                if ks.failed is None and ks.join_refused is None:
                    return ks, [args[0]], plan.n, ks
        prep = self.prepare(args, kwargs)
        if isinstance(prep, str):
            if prep not in CPU_REASONS:
                return prep
            return self._eager_key(args, kwargs)
        key, (leaves, n, spec, meta, autocast, device) = prep
        with self.lock:
            ks = self.store.keys.get(key) or self.key_for(key, spec, meta, autocast, device, leaves)
        if ks is None:
            return f"more than max_keys={self.max_keys} input signatures"
        if ks.failed is not None:
            return ks.failed
        if ks.join_refused is not None:
            return ks.join_refused
        return ks, leaves, n, ks

    def _eager_key(self, args, kwargs):
        try:
            leaves, spec = flatten_inputs(args, kwargs)
        except UnsupportedInput as e:
            return str(e)
        if not leaves:
            return "the call has no tensor inputs to batch"
        if grad_on() and any(t.requires_grad for t in leaves):
            return "an input requires grad and grad mode is on"
        n = batch_size_of(leaves, self.batch_dim)
        if n == 0:
            return "the batch is empty"
        meta = tensor_meta(leaves, self.batch_dim)
        autocast = _compat.autocast_state(leaves[0].device.type)
        key = ("eager", spec, meta, autocast)
        with self.lock:
            ks = self.eager_keys.get(key)
            if ks is None:
                ks = self.eager_keys[key] = Key(describe_key(spec, meta, autocast), spec, leaves[0].device,
                                                autocast, None, None)
        if ks.join_refused is not None:
            return ks.join_refused
        return ks, leaves, n, ks

    def set_join(self, ks: Key, verdict):
        """Record what a join probe showed: ``(kinds, out_spec)``, or why requests must not be joined."""
        if isinstance(verdict, str):
            ks.join_refused = verdict
            logger.warning("graphwrap: requests of %s are not joined: %s", ks.label, verdict)
        else:
            ks.join = verdict
            logger.info("graphwrap: requests of %s are joined along the batch", ks.label)

    def run_joined(self, ks: Key, leaves, n: int):
        """Run a joined batch of at most the largest bucket: its flat outputs, owned by the
        caller; None if the key failed (then every request must run alone)."""
        if ks.seen_as is None:  # a key that runs eagerly for want of CUDA
            args, kwargs = unflatten_inputs(ks.in_spec, leaves)
            reason = CPU_REASONS[1] if _compat.cuda_available() else CPU_REASONS[0]
            return flatten_outputs(self.eager(args, kwargs, reason))[0]
        with self.lock:
            plan = self.plan_for_rows(ks, n, leaves, n)
            if ks.failed is not None:
                return None
            if type(plan) is str or plan.eager:
                args, kwargs = unflatten_inputs(ks.in_spec, leaves)
                out = self.eager(args, kwargs, plan) if type(plan) is str else self.eager_plan(plan, args, kwargs)
                return flatten_outputs(out)[0]
            if plan.device_index != torch.cuda.current_device():
                with torch.cuda.device(plan.device):
                    self.order_stream(plan.device)
                    outs = plan.run(leaves)
            else:
                self.order_stream(plan.device)
                outs = plan.run(leaves)
            if not self.clone:
                outs = [o.clone() if t else o for o, t in zip(outs, plan.is_tensor)]
            return outs

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        with self.lock:
            keys = [self.key_stats(ks) for ks in self.store.keys.values()]
            rows = sum(b["rows"] for k in keys for b in k["buckets"].values()) + sum(k["large_eager_rows"] for k in keys)
            padded = sum(b["padded_rows"] for k in keys for b in k["buckets"].values())
            by_choice = sum(b["eager_calls"] for k in keys for b in k["buckets"].values() if b["serves"] == "eager")
            by_choice += sum(k["large_eager_calls"] for k in keys)
            cf = self.compiled
            return {
                "keys": keys,
                "buckets": None if self.adaptive is not None else list(self.table.buckets),
                "bucket_policy": repr(self.policy) if self.policy is not None else None,
                "compile": None if self.compile_opts is None else {
                    "options": dict(self.compile_opts),
                    "off": self.compile_off,
                    "graphs": cf.graphs if cf is not None else 0,
                    "compile_s": sum(b["compile_s"] for k in keys for b in k["buckets"].values()),
                    "buckets_compiled": sum(bool(b["compiled"]) for k in keys for b in k["buckets"].values()),
                    "background": self.background_state,
                    "background_error": self.background_error,
                    "per_size_graphs": self.static_forward.graphs if self.static_forward is not None else 0,
                    "buckets_per_size": sum(b["kernels"] == "per-size" for k in keys for b in k["buckets"].values()),
                    "tuning": "running" if self.tuner.busy else "idle",
                    "tuning_error": self.tuner.error,
                },
                "eager_calls": dict(self.eager_counts),
                "eager_by_choice": by_choice,
                "graph_pool_bytes": sum(k["pool_bytes"] for k in keys),
                "static_input_bytes": sum(k["static_input_bytes"] for k in keys),
                "rows": rows,
                "padded_rows": padded,
                "padded_share": padded / (rows + padded) if rows + padded else 0.0,
                "device": str(self.store.device) if self.store.device is not None else None,
            }

    @staticmethod
    def key_stats(ks: Key) -> dict:
        counts = {size: [b.replays, b.rows, b.padded_rows, b.eager_calls] for size, b in ks.buckets.items()}
        for plan in ks.plans.values():
            c = counts[plan.size]
            if plan.eager:
                c[3] += plan.calls
                if plan.reason is None:  # eager by choice: its rows are served rows all the same
                    c[1] += plan.calls * plan.n
            else:
                c[0] += plan.calls
                c[1] += plan.calls * plan.n
                c[2] += plan.calls * (plan.size - plan.n)
        buckets = {}
        for size, b in sorted(ks.buckets.items()):
            replays, rows, padded, eager_calls = counts[size]
            buckets[size] = {
                "captured": bool(b.replicas),
                "graphs": len(b.replicas),
                "failed": b.failed,
                "over_budget": b.over_budget,
                "compiled": b.compiled,
                "compiled_graphs": b.compiled_graphs,
                "kernels": b.kernels,
                "shared_us": b.shared_us,
                "per_size_us": b.per_size_us,
                "compile_s": b.compile_s,
                "serves": b.serves if b.replicas else "eager",
                "graph_us": b.graph_us,
                "eager_us": b.eager_us,
                "replays": replays,
                "rows": rows,
                "padded_rows": padded,
                "eager_calls": eager_calls,
                "capture_s": b.capture_s,
                "verify_s": b.verify_s,
                "pool_bytes": b.pool_bytes,
                "pool_estimate": b.pool_estimate,
            }
        return {
            "key": ks.label,
            "status": "eager" if ks.failed else "graphed",
            "reason": ks.failed,
            "eager_calls": ks.eager_calls,
            "large_batches": {f"{k} chunks": how for k, how in sorted(ks.large.items())},
            "large_eager_calls": ks.large_eager,
            "large_eager_rows": ks.large_rows,
            "eager_while_warming": ks.warming_calls,
            "buckets": buckets,
            "pool_bytes": sum(b["pool_bytes"] for b in buckets.values()),
            "static_input_bytes": sum(r.nbytes() for b in ks.buckets.values() for r in b.replicas),
        }
