"""The inference loop: host-to-device copies on a copy stream, hidden behind graph replays.

Per batch, with two graphs per bucket (A and B) taking turns:

    copy stream     wait(A replayed) -> copy inputs into A -> record A.copy_done
    compute stream  wait(A.copy_done) -> replay A -> record A.replay_done -> clone outputs
    d2h stream      wait(clones made) -> copy them to pinned host -> record (to_host only)

so the copy for the next batch (into B) runs while A replays. With ``to_host``, outputs of at
most ``D2H_INLINE_BYTES`` skip the clone and the third stream: their host copy follows the
replay on the compute stream.

The host waits on events only where memory is handed back: a copy that read the caller's
pinned memory is complete before its batch is yielded (the caller may refill that memory), a
staging buffer is refilled once the copy that read it (two batches ago) is over, and with
``to_host=True`` a batch is yielded once its host copy is complete (two batches behind the
newest one issued). Each wait is for work that has later work queued behind it on the device,
so the device does not run dry while the host waits.
"""

import collections
import collections.abc
from typing import Any, Deque, Dict, Iterable, Iterator

import torch

from ..capture.slots import owned
from ..core.plans import cuda_sid as current_stream_id
from ..core.reasons import Eager
from ..core.tree import Tensor, map_tensors
from ..errors import GraphwrapError
from .staging import Stager
from .staging import current_device as _current_device
from .staging import record_event as _record
from .staging import setter as _setter
from .staging import wait_event as _wait

LEASED = 2  # graphs per bucket a loop takes turns on
HOST_LAG = 2  # with to_host, batches issued ahead of the one yielded
# with to_host, outputs up to this size are copied to the host on the compute stream, straight
# from the graph's static outputs; larger ones are cloned and copied on a stream of their own
D2H_INLINE_BYTES = 64 << 10


class Inputs:
    """One call's inputs for :meth:`GraphedModule.pipeline`, when a tuple or dict would be ambiguous.

    ``Inputs(x, mask=m)`` is called as ``gm(x, mask=m)``.
    """

    __slots__ = ("args", "kwargs")

    def __init__(self, *args, **kwargs):
        self.args = args
        self.kwargs = kwargs


def as_call(item):
    """How a pipeline item becomes a call: a tensor is ``gm(t)``, a tuple or list ``gm(*item)``,
    a mapping (a dict, a tokenizer's ``BatchEncoding``) ``gm(**item)``, :class:`Inputs` as given."""
    if isinstance(item, Tensor):
        return (item,), {}
    if isinstance(item, Inputs):
        return item.args, item.kwargs
    if isinstance(item, (tuple, list)):
        return tuple(item), {}
    if isinstance(item, collections.abc.Mapping):
        return (), dict(item)
    raise GraphwrapError(
        f"pipeline item of type {type(item).__name__} is not a tensor, tuple, list, dict or "
        "graphwrap.Inputs; wrap it as graphwrap.Inputs(*args, **kwargs)"
    )


class _Lease:
    """The graphs one loop takes turns on for one bucket (an engine lease), with the loop's
    streams on its device and pinned staging buffers (one set per graph) for pageable inputs."""

    __slots__ = ("lease", "key", "replicas", "turn", "staging", "bucket", "size", "device", "copy_stream",
                 "d2h_stream", "to_copy", "compute", "to_compute")

    def __init__(self, lease, device, streams, compute):
        self.lease = lease
        self.key, self.bucket, self.replicas = lease.key, lease.bucket, lease.graphs
        self.turn = 0
        self.staging = Stager(turns=len(self.replicas))
        self.size = self.bucket.size
        self.device = device
        self.copy_stream, self.d2h_stream = streams
        self.to_copy = _setter(self.copy_stream)
        self.compute = self.to_compute = None  # the caller's stream of the last batch, and its setter
        for rep in self.replicas:
            if rep.copy_done is None:
                rep.copy_done, rep.replay_done = torch.cuda.Event(), torch.cuda.Event()
        # Copies into these graphs' inputs come after all the work issued so far: their captures,
        # earlier loops, gm(...) calls (ordered onto the caller's stream by Engine.order_stream).
        self.copy_stream.wait_stream(compute)

    def back_to(self, compute):
        """The setter of the caller's stream ``compute`` (made again only when it changes)."""
        if compute is not self.compute:
            self.compute, self.to_compute = compute, _setter(compute)
        return self.to_compute


class _EventPool:
    def __init__(self):
        self.free = []

    def get(self):
        return self.free.pop() if self.free else torch.cuda.Event()

    def put(self, ev):
        self.free.append(ev)


def run_pipeline(engine, batches: Iterable[Any], to_host: bool = False) -> Iterator[Any]:
    it = iter(batches)
    pending: Deque[Any] = collections.deque()
    # (key tuple, batch size) -> _Lease, and (Key, bucket size) -> the same lease. Keys are held,
    # not their ids: a key dropped by reset() must never be mistaken for a new one that Python
    # put at the same address.
    leases: Dict[Any, Any] = {}
    # The plan gm(t) has for a lone tensor t -> its lease: a batch of a shape seen before takes
    # gm(t)'s own per-call checks (Engine.fast_plan) and one lookup, not the general signature.
    by_plan: Dict[Any, Any] = {}
    events = _EventPool()
    streams: Dict[Any, Any] = {}
    epoch = engine.epoch
    lag = HOST_LAG if to_host else 0
    facts, fast_plan = engine.facts, engine.fast_plan
    try:
        for item in it:
            entry = lease = plan = None
            if type(item) is Tensor:
                plan = fast_plan(item)
                if plan is not None:
                    lease = by_plan.get(plan)
            if lease is not None and plan is not None and engine.epoch == epoch:
                entry = _issue(engine, lease, (item,), plan.n, events, to_host)
            else:
                args, kwargs = as_call(item)
                f = facts(args, kwargs)
                if engine.epoch != epoch:
                    # The graphs were dropped (weights replaced or moved, reset()): so are the leases.
                    # release() synchronized the device, so no copy into their buffers is in flight.
                    _sync(streams)
                    leases.clear()
                    by_plan.clear()
                    epoch = engine.epoch
                if type(f) is not Eager:
                    lease = _lease_for(engine, f, leases, streams)
                    if lease is not None:
                        if type(item) is Tensor:
                            _remember(fast_plan(item), lease, f.n, by_plan)
                        entry = _issue(engine, lease, f.leaves, f.n, events, to_host)
            if entry is None:
                # Eager, a failed capture, a bucket that serves eagerly, a batch above the largest
                # bucket, inputs with a sequence dimension: the direct call serves it, in order on
                # the caller's stream.
                out = engine.call(*as_call(item))
                if to_host:
                    out = map_tensors(_to_pinned_host, out)
                entry = ("done", out)
            if lag:
                pending.append(entry)
                if len(pending) > lag:
                    yield _finish(pending.popleft(), events)
            else:
                yield _finish(entry, events)
        while pending:
            yield _finish(pending.popleft(), events)
    finally:
        _close(engine, streams, pending, leases, epoch)


def _close(engine, streams, pending, leases, epoch):
    """Leave no copy in flight on memory the loop owns or is about to drop; give its graphs back."""
    _sync(streams)
    for entry in pending:
        if entry[0] == "host":
            entry[3].synchronize()
    if engine.epoch == epoch:
        for lease in {id(v): v for v in leases.values()}.values():
            engine.give_back(lease.lease)


def _remember(plan, lease, n, by_plan):
    """Serve later batches of ``plan`` (gm(t)'s plan for this tensor's shape) by ``lease``."""
    if plan is not None and not plan.eager and plan.L is None and plan.n == n and plan.key is lease.key:
        by_plan[plan] = lease


def _sync(streams):
    for copy_stream, d2h_stream in streams.values():
        copy_stream.synchronize()
        d2h_stream.synchronize()


def _lease_for(engine, f, leases, streams):
    """The loop's lease for a call's facts, taken (its graphs captured) on first use; None if
    the direct call must serve it."""
    n, device = f.n, f.device
    lease = leases.get((f.key, n))  # (key, n) -> lease: one lookup a batch once seen
    if lease is None:
        if engine.backend.kind != "cuda" or f.L is not None:
            return None
        plan = engine.plan(f)
        lease = leases.get((plan.key, plan.bucket.size))
        if lease is None:
            taken = engine.lease(plan, LEASED)
            if taken is None:
                return None
            s = streams.get(device)
            if s is None:
                s = streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            with engine.lock:
                compute = engine.order_stream(device)
            lease = leases[(taken.key, taken.bucket.size)] = _Lease(taken, device, s, compute)
        leases[(f.key, n)] = lease
    return lease


def _issue(engine, lease, leaves, n, events, to_host):
    """Issue one batch's copies, replay and output copies; None if the direct call must serve it."""
    if lease.key.failed is not None:
        return None
    i = lease.turn
    rep = lease.replicas[i]
    lease.turn = i + 1 if i + 1 < len(lease.replicas) else 0
    read_pinned = pageable = False
    for t in leaves:
        if not t.is_cuda:
            if t.is_pinned():
                read_pinned = True
            else:
                pageable = True
    # outside the lock: host copies into the loop's buffers
    srcs = _stage_pageable(lease, i, rep, leaves, n) if pageable else leaves
    host_out = None
    if to_host and rep.out_bytes <= D2H_INLINE_BYTES:
        host_out = _pinned_like(rep.outputs_for(n, None), rep.is_tensor)
    device = lease.device
    with engine.lock:
        if device.index != _current_device():
            with torch.cuda.device(device):
                entry = _issue_on(engine, lease, rep, srcs, n, events, to_host, host_out)
        else:
            entry = _issue_on(engine, lease, rep, srcs, n, events, to_host, host_out)
    if rep.ring is not None and rep.ring.wanted and rep.ring.claim():
        engine.grow(rep)
    if read_pinned:
        # The copy read the caller's pinned memory asynchronously. It is over before this batch's
        # output is yielded and before the iterator runs again, either of which may refill that
        # memory in place (one pinned buffer reused for every batch is a common loop).
        rep.copy_done.synchronize()
    if entry[0] == "d2h":
        # Owned copies, made on the compute stream under the lock; to the host on a stream of
        # their own. The copies stay referenced (in the entry) until the host has waited for `done`.
        _, spec, outs, compute = entry
        d2h_stream = lease.d2h_stream
        d2h_stream.wait_stream(compute)
        host = _pinned_like(outs, rep.is_tensor)
        with torch.cuda.stream(d2h_stream):
            _copy_all(host, outs, rep.is_tensor)
            done = events.get()
            done.record(d2h_stream)
        entry = ("host", spec, host, done, outs)
    return entry


def _issue_on(engine, lease, rep, srcs, n, events, to_host, host_out):
    """The batch's copy in, replay and copy out, in stream order; the entry for ``_finish``. The
    caller holds the engine's lock."""
    sid = current_stream_id(lease.device.index)
    # The caller's stream: the last call's, unless another stream issued since (then ordered
    # after it): no Stream object is made for a batch on the same stream as the last.
    compute = engine.last_stream if sid == engine.last_sid else engine.order_stream(lease.device)
    lease.bucket.replayed(n)
    ks = lease.key
    _copy_in(lease, rep, rep.inputs_for(n, None)[0], srcs, compute)
    if (not to_host and not engine.clone) or host_out is not None:
        rep.graph.replay()
        _record(rep.replay_done, compute)
        if host_out is None:
            # outputs="view": the static outputs themselves, valid until the next batch is issued
            # (when the caller asks for the next item), as gm(...) views are until the next call.
            return ("gpu", ks.out_spec, rep.outputs_for(n, None))
        # Small outputs: copied to the host in stream order right after the replay, before any
        # later replay can overwrite them. That adds a few microseconds of device time and saves
        # a clone and a hop to another stream, which cost more host time than the copy takes.
        _copy_all(host_out, rep.outputs_for(n, None), rep.is_tensor)
        done = events.get()
        done.record(compute)
        return ("host", ks.out_spec, host_out, done, None)
    # Owned outputs: a free slot of the graph's output ring (its graph runs the forward into the
    # slot), or the graph and clones made right after it: graphs share one pool, so a static
    # output can sit in memory that the next replay of another bucket uses for intermediates.
    slot = rep.ring.take(sid) if rep.ring is not None else None
    outs = owned(rep, slot, rep.outputs_for(n, None), n, None)  # a slot due is made by _issue off the lock
    _record(rep.replay_done, compute)
    if not to_host:
        return ("gpu", ks.out_spec, outs)
    return ("d2h", ks.out_spec, outs, compute)


def _pinned_like(outs, is_tensor):
    """New pinned host tensors shaped as the tensor outputs (the others as they are)."""
    return [torch.empty(o.shape, dtype=o.dtype, pin_memory=True) if t else o for o, t in zip(outs, is_tensor)]


def _copy_all(dsts, srcs, is_tensor):
    for d, s, t in zip(dsts, srcs, is_tensor):
        if t:
            d.copy_(s, non_blocking=True)


def _stage_pageable(lease, i, rep, leaves, n):
    """``leaves`` with each pageable host tensor copied into graph ``i``'s pinned staging buffer
    (owned by the loop), once the copy that read that buffer (two batches ago) is over."""
    rep.copy_done.synchronize()
    return [t if t.is_cuda or t.is_pinned() else _stage(lease, i, j, rep, t, n) for j, t in enumerate(leaves)]


def _copy_in(lease, rep, dsts, srcs, compute):
    """Copy a batch into ``rep``'s static inputs: device inputs on the compute stream (in order
    after whatever made them), host inputs (pinned by now) on the copy stream once the graph's
    last replay is done."""
    on_copy = None
    for d, s in zip(dsts, srcs):
        if s.is_cuda:
            d.copy_(s)
        elif on_copy is None:
            on_copy = [(d, s)]
        else:
            on_copy.append((d, s))
    if on_copy is None:
        return
    copy_stream = lease.copy_stream
    _wait(rep.replay_done, copy_stream)  # the inputs are free once the last replay is done
    back = lease.back_to(compute)
    lease.to_copy()
    try:
        for d, s in on_copy:
            d.copy_(s, non_blocking=True)
        _record(rep.copy_done, copy_stream)
    finally:
        back()
    _wait(rep.copy_done, compute)


def _stage(lease, i, j, rep, src, n):
    """Copy a pageable input into this graph's pinned staging buffer (owned by the loop)."""
    bd = rep.roles[j][0]
    view, _ = lease.staging.buffer(i, j, src.shape, src.dtype, bd if bd is not None else 0)
    view.copy_(src)
    return view


def _to_pinned_host(t):
    if not t.is_cuda:
        return t
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(t)
    return h


def _finish(entry, events):
    kind = entry[0]
    if kind == "done":
        return entry[1]
    if kind == "gpu":
        return entry[1].rebuild(entry[2])
    _, spec, host, done, _device_copies = entry
    done.synchronize()
    events.put(done)
    return spec.rebuild(host)
