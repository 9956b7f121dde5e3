"""The engine: input signatures -> buckets -> captured graphs, and the plans that replay them.

The loops (the direct call in ``calls``, ``pipeline``, ``coalesce``, the ``Batcher``'s queue,
``decode``) drive it through these names and nothing else:

- ``call(args, kwargs)``: ``gm(*args, **kwargs)``: a warm one-tensor call's plan, else the
  direct-call loop (:func:`graphwrap.loops.calls.call_general`).
- ``facts(args, kwargs)``: the call as the engine sees it (``signature.Facts``), or why it runs
  eagerly (a :class:`~graphwrap.core.reasons.Eager`); ``fast_plan(x)``: the plan of ``gm(x)``
  for one tensor of a shape seen before.
- ``plan(facts)``, ``plan_rows(key, n, L, leaves)``: the :class:`~graphwrap.core.plans.Plan`
  (graph, eager, or chunked), its bucket captured first if need be, outside the serving lock
  (others run that bucket eagerly meanwhile).
- ``run(plan, leaves)``: copy in, replay, outputs out, under the serving lock.
- ``eager(args, kwargs, why)``, ``eager_plan(plan, args, kwargs)``, ``eager_run(args, kwargs)``:
  the module itself, counted.
- ``joins``: what joining requests needs (:class:`~graphwrap.loops.joins.Joins`: ``member``,
  ``run_joined``, ``set_join``, ``cost``, ``max_rows``).
- ``chose_large``, ``served_large``, ``staging``: the direct call's records of batches above the
  largest bucket.
- ``lease(plan, count)`` and ``give_back(lease)``: graphs for one loop's sole use (pipeline).
- ``key(facts)``: a call's key, or why it runs eagerly (under ``lock``); ``writes``: the module
  buffers the forward writes; ``grow(graph)``: another owned-output slot, off the call path.
- ``capture(facts, background)``, ``wait()``, ``reset()``, ``stats()``, ``copy_stream(device)``,
  ``order_stream(device)``; the attributes ``lock``, ``epoch``, ``grid``, ``clone``,
  ``batch_dim``, ``backend``, ``module``, ``decl`` (the options' ``Declarations``), ``opts``,
  ``eager_if_faster``.

The engine maps keys to plans; its :class:`~graphwrap.capture.capturer.Capturer` is the only
writer of capture state and of what serves a bucket. Nothing under ``lock`` captures, compiles,
times or waits for the device: a capture claims its bucket, runs outside the lock and installs
its graph under it.
"""
import contextlib
import logging
import threading
from typing import Any, Callable, Dict, Optional

import torch

from .. import _compat
from ..capture.backend import CudaBackend
from ..capture.capturer import Capturer
from ..capture.cuda import on_device
from ..errors import GraphwrapError
from ..loops.calls import call_general
from ..loops.joins import Joins
from ..loops.staging import Stager
from . import stats as _stats
from .buckets import Adaptive, BucketTable, padded_rows
from .grid import Grid
from .plans import NO_BUCKET, STALE, Plan
from .reasons import GLOBAL_HOOKS, NEEDS_GRAD, TRAINING, WRITES_LARGE, Eager, Kind, capture_reason
from .records import Bucket, Graph, Key, Lease, Serves, Store, drop
from .signature import Facts, describe_key, state_refs
from .tree import (
    flatten_inputs,
    requires_grad_shallow,
    to_device_shallow,
)
from .watch import GLOBAL_TABLES, Watch

logger = logging.getLogger("graphwrap")
Tensor = torch.Tensor
SINGLE_TENSOR_SPEC = flatten_inputs((torch.empty(0),), {})[1]
autocast_on = torch._C.is_autocast_enabled  # CUDA autocast on, in one C call (torch >= 2.1)
grad_on = torch.is_grad_enabled
EXACT_LENGTHS = 32  # graphs per exact length of a key whose padding is refused, then eager
# None on a torch built without CUDA: then no plan's device is "cuda".
_current_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", None)  # type: ignore[assignment]
_GLOBAL_PRE, _GLOBAL_POST = GLOBAL_TABLES  # torch.nn's global forward hook tables (mutated in place)


class Engine:
    """Captures and replays one module's graphs; shared by every loop that drives it."""

    def __init__(self, module, opts):
        self.module, self.opts = module, opts
        self.decl = opts.declarations(module)
        self.compile_opts = opts.compile_opts()
        self.policy = opts.buckets if isinstance(opts.buckets, Adaptive) else None
        self.adaptive = self.policy if self.policy is not None and self.policy.buckets is None else None
        self.grid = opts.grid(self.compile_opts, self.decl.has_seq)
        self.batch_dim = self.decl.default_bd
        self.clone = opts.outputs == "clone"
        self.fallback, self.verify, self.max_keys = opts.fallback, bool(opts.verify), opts.max_keys
        self.eager_if_faster = bool(opts.eager_if_faster)
        self.backend = CudaBackend()
        self.lock = threading.RLock()
        self.store = Store(lambda d: self.backend.sync(d))
        self.epoch = 0  # bumped by reset(): plans and leases of an older epoch are dropped
        self.eager_counts: Dict[str, int] = {}
        self.logged = set()
        self.last_stream = self.last_sid = None
        self.watch = Watch(module)  # what the graphs depend on besides their inputs
        self.changes: Dict[str, int] = {}  # graphs dropped because the module changed, by what changed
        self.generates: Dict[str, int] = {}  # gm.generate calls, by how their decode steps were run
        self.where: Any = None  # the device graphs run on, or why none; None: not known yet
        self.fast: Dict[torch.Size, Plan] = self.store.fast  # full input shape -> plan, for gm(x) with one tensor
        self._copy_streams: Dict[torch.device, Any] = {}
        self.capturer = Capturer(self)  # the only writer of capture state and of what serves a bucket
        self.joins = Joins(self)

    # ------------------------------------------------------------------ per call

    def call(self, args, kwargs):
        """``gm(*args, **kwargs)``: the plan of one tensor of a shape seen before, where every
        per-call check passes (a copy, a replay and the output), else the direct-call loop."""
        if not kwargs and len(args) == 1:
            x = args[0]
            if type(x) is Tensor:
                plan = self.fast_plan(x)
                if plan is not None:
                    out = plan.call1(x)
                    if out is not STALE:
                        return out
        return call_general(self, args, kwargs)

    def fast_plan(self, x: Tensor) -> Optional[Plan]:
        """The plan for ``gm(x)`` with one tensor, if every per-call check passes; else None
        (the caller takes the general path, which says why or builds the plan)."""
        plan = self.fast.get(x.shape)
        if (plan is None or plan.dtype is not x.dtype or plan.dev != x.get_device() or self.module.training
                or (x.requires_grad and grad_on()) or _GLOBAL_PRE or _GLOBAL_POST):
            return None
        if plan.eager or (self.watch.current() and not autocast_on()):
            return plan
        return None

    def facts(self, args, kwargs):
        """The call's :class:`~graphwrap.core.signature.Facts`, or the :class:`~graphwrap.core.reasons.Eager`
        reason it runs eagerly."""
        if self.module.training:
            self.decl.check_unkeyed(args, kwargs)
            return TRAINING
        if _GLOBAL_PRE or _GLOBAL_POST:
            return GLOBAL_HOOKS
        why = self.watch.look()
        if why is not None:
            self._changed(why)
        if self.watch.eager is not None:  # a submodule in training mode
            return self.watch.eager
        where = self.where if self.where is not None else self._where()
        if type(where) is Eager:
            self.decl.check_unkeyed(args, kwargs)
            return where
        single = SINGLE_TENSOR_SPEC if not kwargs and len(args) == 1 and type(args[0]) is Tensor else None
        f = self.decl.facts(args, kwargs, _compat.autocast_state("cuda"), single)
        if type(f) is Eager:
            return f
        if where is False:  # a module without tensors: it runs where its inputs are
            where = self.backend.device_for(None, f.leaves)
            if type(where) is Eager:
                return where
        f.device = where
        if grad_on() and any(t.requires_grad for t in f.leaves):
            return NEEDS_GRAD
        if self.adaptive is not None:
            return self._observe(f.n)
        return f

    def _where(self):
        device = self.watch.device()
        self.where = False if device is None else self.backend.device_for(device, ())
        return self.where

    def plan(self, f: Facts) -> Plan:
        """The plan of a call: kept per key and size, made (and its bucket captured) on first use."""
        try:
            with self.lock:
                ks = self.key(f)
        except _DeviceChanged:
            self.reset()
            with self.lock:
                ks = self.key(f)
        if type(ks) is Eager:
            return Plan.eager_only(self, ks)
        plan = self.plan_rows(ks, f.n, f.L, f.leaves)
        if ks.single is not None and not plan.chunked and ks.plans.get((f.n, f.L)) is plan:
            self.fast[f.leaves[0].shape] = plan
        return plan

    def plan_rows(self, ks: Key, n: int, L: Optional[int], leaves) -> Plan:
        for _ in range(4):  # a capture changes what the next look finds: at most a few turns
            with self.lock:
                got = self._plan_for(ks, n, L)
            if type(got) is Plan:
                return got
            self.capturer.capture(ks, got, leaves, n, L)
        return Plan(self, ks, n, L, NO_BUCKET, eager=True)

    def _plan_for(self, ks: Key, n: int, L: Optional[int]):
        """The plan for ``n`` rows and length ``L`` of ``ks``, or a bucket to capture first
        (marked as capturing). The caller holds the lock."""
        if ks.failed is not None:
            ks.eager_calls += 1
            return Plan(self, ks, n, L, NO_BUCKET, reason=capture_reason(ks.failed))
        plan = ks.plans.get((n, L))
        if plan is not None and plan.epoch == self.epoch:
            return plan
        S = self._seq_bucket(ks, L)
        if type(S) is Eager:
            return Plan(self, ks, n, L, NO_BUCKET, reason=S)
        top = self.grid.top(S)
        if self.capturer.writes is not None or ks.fixed:  # state written per row or position: never padded or chunked
            if n > top:
                return Plan(self, ks, n, L, NO_BUCKET, reason=WRITES_LARGE)
            size = n
        elif n > top and S is not None:
            plan = ks.plans[(n, L)] = Plan(self, ks, n, L, NO_BUCKET, chunked=True)
            return plan
        else:
            size = self.grid.size(n, S)
        b, claimed = self.capturer.claim(ks, size, S, not (ks.warming and size <= top))
        if claimed:
            return b
        st = b.serves
        if st is Serves.NOTHING or st is Serves.CAPTURING:
            ks.warming_calls += 1  # captured elsewhere meanwhile: eager now, not kept
            return Plan(self, ks, n, L, NO_BUCKET, eager=True)
        if size > top and st in (Serves.FAILED, Serves.OVER_BUDGET):  # no memory for a graph of its own
            plan = ks.plans[(n, L)] = Plan(self, ks, n, L, NO_BUCKET, chunked=True)
            return plan
        if st is Serves.OVER_BUDGET:
            larger = self._larger(ks, size, S)
            if larger is None:  # not kept: a larger bucket captured later serves these batches
                return Plan(self, ks, n, L, b, reason=capture_reason(b.reason))
            b = larger
        plan = ks.plans[(n, L)] = Plan(self, ks, n, L, b, reason=capture_reason(b.reason) if st is Serves.FAILED else None,
                                       eager=b.serves is Serves.EAGER)
        if b.compiled and b.kernels == "shared" and not b.tuned and self.compile_opts.get("static") == "auto":
            from ..capture.tuning import HOT_CALLS
            served = b.replays + sum(p.calls for p in ks.plans.values() if p.bucket is b)
            plan.tune_at = max(1, HOT_CALLS - served)
        return plan

    def _seq_bucket(self, ks: Key, L: Optional[int]):
        if not ks.has_seq:
            return None
        if self.capturer.writes is not None and ks.exact is None:
            ks.exact = "the forward writes module buffers"
        S = self.grid.seq_for(L, exact=ks.exact is not None)
        if S is None:
            return Eager(f"length {L} is longer than the longest sequence bucket ({self.grid.max_len}); pass "
                         "seq_buckets= with a longer one", Kind.LIMIT)
        if ks.exact is not None and len({s for _, s in ks.buckets}) >= EXACT_LENGTHS and \
                not any(s == S for _, s in ks.buckets):
            return Eager(f"{ks.exact}; graphs for {EXACT_LENGTHS} exact lengths are captured, further lengths run "
                         "eagerly", Kind.LIMIT)
        return S

    def run(self, plan: Plan, leaves, clone: bool = True):
        """Copy in, replay, outputs out (owned unless ``clone`` is False); ``STALE`` if the plan's
        graphs were dropped meanwhile."""
        with self.lock:
            if plan.epoch != self.epoch:
                return STALE
            if plan.sid(plan.device_index) != self.last_sid:
                self.order_stream(plan.device)
            if plan.device.type == "cuda" and plan.device_index != _current_device():
                with torch.cuda.device(plan.device):
                    outs = plan.run(leaves, clone)
            else:
                outs = plan.run(leaves, clone)
        ring = plan.ring
        if ring is not None and ring.wanted and ring.claim():  # every slot was held: another, off the lock
            self.grow(plan.graph)
        return outs

    # ------------------------------------------------------------------ batches above the largest bucket

    def chose_large(self, ks: Key, chunks: int, how: str):
        """Batches of ``chunks`` chunks of ``ks`` run ``how`` ("graph": chunked replays; "eager")."""
        with self.lock:
            ks.large[chunks] = how

    def served_large(self, ks: Key, n: int):
        """A batch of ``n`` rows above the largest bucket ran in one eager forward (counted)."""
        with self.lock:
            ks.large_eager += 1
            ks.large_rows += n

    def staging(self, ks: Key) -> Stager:
        """The device buffers large host batches of ``ks`` are copied into, in turns."""
        with self.lock:
            if ks.staging is None:
                ks.staging = Stager(ks.device)
            return ks.staging

    # ------------------------------------------------------------------ eager

    def eager_run(self, args, kwargs, grad: bool = False):
        """The module run eagerly, with host tensors of plain containers moved to its device;
        without grad unless ``grad``: outputs never require grad but where eager runs for it."""
        device = self.where if isinstance(self.where, torch.device) else None
        if device is not None:
            args, kwargs = to_device_shallow((args, kwargs), device)
        keep = grad or not grad_on() or requires_grad_shallow((args, kwargs))
        with on_device(device), contextlib.nullcontext() if keep else torch.no_grad():
            return self.module(*args, **kwargs)

    def eager(self, args, kwargs, why: Eager):
        """Run eagerly for ``why``: counted by its words in ``stats()["eager_calls"]``, logged the first time."""
        counts, reason = self.eager_counts, why.reason
        counts[reason] = counts.get(reason, 0) + 1
        if counts[reason] == 1:
            self.log_once(("eager", reason), logging.WARNING, f"running eagerly: {reason}")
        return self.eager_run(args, kwargs, grad=why.kind is Kind.GRAD)

    def eager_plan(self, plan: Plan, args, kwargs):
        """A call whose plan runs eagerly: by choice (eager measured faster) or for a reason."""
        plan.calls += 1
        if plan.reason is not None:
            return self.eager(args, kwargs, plan.reason)
        return self.eager_run(args, kwargs)

    def log_once(self, tag, level, msg):
        if tag not in self.logged:
            self.logged.add(tag)
            logger.log(level, msg)

    # ------------------------------------------------------------------ keys

    def key(self, f: Facts):
        """The key of a call, made on first use, or why it runs eagerly. The caller holds the lock."""
        return self.store.keys.get(f.key) or self.key_for(f)

    @property
    def writes(self) -> Optional[tuple]:
        """The module buffers the forward writes, once a capture saw it (None: none seen)."""
        return self.capturer.writes

    def key_for(self, f: Facts):
        """The key of a call (made on first use), or why it runs eagerly. The caller holds the lock."""
        store = self.store
        if len(store.keys) >= self.max_keys:
            return Eager(f"more than max_keys={self.max_keys} input signatures", Kind.LIMIT)
        device = f.device
        for i, t in enumerate(f.leaves):
            if t.is_cuda and t.device != device:
                raise GraphwrapError(f"input tensor #{i} is on {t.device} but the module is on {device}; move it with "
                                     f".to({str(device)!r}) (CPU tensors are copied over for you)")
        if store.device is not None and store.device != device:
            raise _DeviceChanged  # reset() outside the lock, then the call is planned again
        store.device = device
        single = None
        if f.spec is SINGLE_TENSOR_SPEC and f.autocast is None and f.L is None and f.roles[0][0] is not None:
            single = (f.meta[0][1], f.leaves[0].get_device())
        seen = describe_key(f.spec, tuple((s, d, device) for s, d, _ in f.meta), f.autocast)
        ks = Key(describe_key(f.spec, f.meta, f.autocast), f.spec, f.roles, device, f.autocast, seen, single,
                 has_seq=f.L is not None)
        ks.host = any(t.device != device for t in f.leaves)
        if f.state:
            ks.fixed, ks.states = True, state_refs(f.spec)
        store.keys[f.key] = ks
        return ks

    def _changed(self, why: str):
        """Something the graphs depend on changed: they are dropped, and captured again as calls come."""
        self.changes[why] = self.changes.get(why, 0) + 1
        self.log_once(("changed", why), logging.INFO,
                      f"{why}; dropping the graphs, they are captured again on the next calls")
        self.reset()
        self.watch.look()

    def _observe(self, n: int) -> Eager:
        """Count a batch size for the Adaptive policy; the call runs eagerly."""
        with self.lock:
            adaptive = self.adaptive
            if adaptive is not None:
                buckets = adaptive.observe(n)
                if buckets is not None:
                    self.grid = Grid(BucketTable(buckets), self.opts.seq_buckets, self.decl.has_seq,
                                     self.opts.max_tokens)
                    self.adaptive = None
                    hist = adaptive.histogram
                    rows, pad = sum(k * v for k, v in hist.items()), padded_rows(buckets, hist)
                    logger.info("adaptive buckets %s from %d calls; %.1f%% of their rows would be padding",
                                buckets, adaptive.seen, 100.0 * pad / (rows + pad))
        counted = self.policy.warmup_calls if self.policy is not None else 0
        return Eager(f"adaptive buckets: counting batch sizes over the first {counted} calls",
                     Kind.LIMIT)

    def reset(self):
        """Drop every graph and static buffer; the next calls capture again. The wait for the
        device's last replays happens outside the lock."""
        self.capturer.cancel()
        with self.lock:
            held = self.store.detach()
            self.epoch = self.store.epoch
            self.watch.clear()
            self.decl.forget()
            self.last_stream = self.last_sid = None
            self.where = None
        drop(held, self.backend.sync)

    # ------------------------------------------------------------------ capture

    def capture(self, f: Facts, background: bool = False) -> dict:
        """Capture every bucket of this call's key, largest first (``background``: on the worker)."""
        with self.lock:
            ks = self.key(f)
            if type(ks) is Eager:
                raise GraphwrapError(f"cannot capture: {ks}; pass a larger max_keys= or call reset()")
        got = self.capturer.capture_key(ks, [t.to(ks.device, copy=True) for t in f.leaves], f.n, f.L, background)
        return self.stats() if background or got is None else got

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self.capturer.wait(timeout)

    def _larger(self, ks: Key, size: int, S) -> Optional[Bucket]:
        for s in self.grid.table(S).buckets:
            b = ks.buckets.get((s, S))
            if s > size and b is not None and b.serves is Serves.GRAPH:
                return b
        if self.fallback == "raise":
            raise GraphwrapError(f"bucket {size} of {ks.label} is over max_pool_bytes and no larger bucket is captured; "
                                 'raise max_pool_bytes, call capture() first (it takes the largest buckets first) or '
                                 'pass fallback="eager"')
        return None

    # ------------------------------------------------------------------ told by plans

    def grow(self, graph: Graph, later: bool = False):
        """Another owned-output slot for ``graph`` (a call found every slot held), made off the
        call path (``Capturer.grow``: never waiting for another module's capture or compile)."""
        self.capturer.grow(graph, later)

    # ------------------------------------------------------------------ streams

    def order_stream(self, device):
        """The caller's current stream, made to wait for the last call's work if it is another.

        The static buffers and the pool are shared by every caller: work issued on another
        stream must not touch them before the last call's work is done.
        """
        from .plans import cuda_sid

        last = self.last_stream
        cur = torch.cuda.current_stream(device)
        if last is not None and last != cur:
            cur.wait_stream(last)
        self.last_stream = cur
        self.last_sid = cuda_sid(device.index) if cuda_sid is not None else None
        return cur

    def copy_stream(self, device):
        """A stream of the engine's own on ``device`` for host-to-device copies."""
        s = self._copy_streams.get(device)
        if s is None:
            s = self._copy_streams[device] = torch.cuda.Stream(device)
        return s

    # ------------------------------------------------------------------ leases (pipeline)

    def lease(self, plan: Plan, count: int) -> Optional[Lease]:
        """``count`` graphs of the bucket of a plan (``plan(facts)``), for one loop's sole use,
        captured as needed; None where ``gm(...)`` must serve the call (eager, chunked,
        sequences, not CUDA)."""
        return self.capturer.lease(plan, count)

    def give_back(self, lease: Lease):
        self.capturer.give_back(lease)

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        with self.lock:
            return _stats.engine_stats(self)


class _DeviceChanged(Exception):
    """A call on another device than the graphs held: they are dropped first."""
