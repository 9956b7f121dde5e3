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
import functools
from typing import Any, Iterable, Iterator

import torch

from .calls import call
from .engine import Engine
from .plans import current_stream_id
from .errors import GraphwrapError
from .tree import Tensor, map_tensors

set_stream = torch.cuda.set_stream
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
# The C calls behind torch.cuda.set_stream, Event.record(stream) and Stream.wait_event(event),
# without their Python layers: at batch 1 the loop is bound by host time, a microsecond a step
# counts. The stream is always given, so the wrappers' only logic (defaulting it) is not needed.
_cuda_set_stream = getattr(torch._C, "_cuda_setStream", None)
_event_base = getattr(torch._C, "_CudaEventBase", None)  # a stand-in type, or absent, without CUDA
_record = getattr(_event_base, "record", None) or torch.cuda.Event.record
_wait = getattr(_event_base, "wait", None) or torch.cuda.Event.wait


def _setter(stream):
    """A no-argument callable that makes ``stream`` current, as ``torch.cuda.set_stream`` does."""
    if _cuda_set_stream is None:
        return functools.partial(set_stream, stream)
    return functools.partial(_cuda_set_stream, stream_id=stream.stream_id, device_index=stream.device_index,
                             device_type=stream.device_type)

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
    a dict ``gm(**item)``, :class:`Inputs` as given."""
    if isinstance(item, Tensor):
        return (item,), {}
    if isinstance(item, Inputs):
        return item.args, item.kwargs
    if isinstance(item, (tuple, list)):
        return tuple(item), {}
    if isinstance(item, dict):
        return (), item
    raise GraphwrapError(
        f"pipeline item of type {type(item).__name__} is not a tensor, tuple, list, dict or "
        "graphwrap.Inputs; wrap it as graphwrap.Inputs(*args, **kwargs)"
    )


class _Lease:
    """The graphs one loop takes turns on for one bucket, with the loop's streams on its device
    and pinned staging buffers for pageable inputs."""

    __slots__ = ("key", "replicas", "turn", "staging", "bucket", "size", "device", "copy_stream", "d2h_stream",
                 "to_copy", "compute", "to_compute")

    def __init__(self, key, replicas, bucket, device, streams, compute):
        self.key = key
        self.replicas = replicas
        self.turn = 0
        self.staging = {}  # replica index -> pinned buffers for pageable inputs
        self.bucket = bucket
        self.size = bucket.size
        self.device = device
        self.copy_stream, self.d2h_stream = streams
        self.to_copy = _setter(self.copy_stream)
        self.compute = self.to_compute = None  # the caller's stream of the last batch, and its setter
        for rep in replicas:
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


def run_pipeline(engine: Engine, batches: Iterable[Any], to_host: bool = False) -> Iterator[Any]:
    it = iter(batches)
    pending = collections.deque()
    # (Key, bucket size) -> _Lease, and (key tuple, batch size) -> the same lease. Keys are held,
    # not their ids: a key dropped by reset() must never be mistaken for a new one that Python
    # put at the same address.
    leases = {}
    events = _EventPool()
    streams = {}
    epoch = engine.epoch
    lag = HOST_LAG if to_host else 0
    prepare = engine.prepare
    try:
        for item in it:
            if type(item) is Tensor:
                args, kwargs = (item,), {}
            else:
                args, kwargs = as_call(item)
            prep = prepare(args, kwargs)
            if engine.epoch != epoch:
                # The graphs were dropped (weights replaced or moved, reset()): so are the leases.
                # release() synchronized the device, so no copy into their buffers is in flight.
                _sync(streams)
                leases.clear()
                epoch = engine.epoch
            entry = None
            if type(prep) is not str:
                entry = _issue(engine, prep, leases, streams, events, to_host)
            if entry is None:
                # Eager, a failed capture, a bucket that serves eagerly, or a batch above the
                # largest bucket: the direct call serves it, in order on the caller's stream.
                out = call(engine, args, kwargs)
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
        # Leave no copy in flight on memory this loop owns or is about to drop.
        _sync(streams)
        for entry in pending:
            if entry[0] == "host":
                entry[3].synchronize()
        with engine.lock:
            if engine.epoch == epoch:
                for lease in leases.values():
                    engine.give_back(lease.replicas)


def _sync(streams):
    for copy_stream, d2h_stream in streams.values():
        copy_stream.synchronize()
        d2h_stream.synchronize()


def _issue(engine, prep, leases, streams, events, to_host):
    """Issue one batch's copies, replay and output copies; None if the direct call must serve it."""
    key, (leaves, n, spec, meta, autocast, device) = prep
    with engine.lock:
        lease = leases.get((key, n))  # (key, n) -> lease: one lookup a batch once seen
        if lease is None:
            ks = engine.key_of(prep)
            if ks is None:
                return None
            size = engine.table.size_for(n)
            lease = leases.get((ks, size))
            if lease is None:
                taken = engine.lease(prep, LEASED)
                if taken is None:
                    return None
                ks, bucket, reps = taken
                s = streams.get(device)
                if s is None:
                    s = streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
                lease = leases[(ks, size)] = _Lease(ks, reps, bucket, device, s, engine.order_stream(device))
            leases[(key, n)] = lease
        if lease.key.failed is not None:
            return None
        if device.index != _current_device():
            with torch.cuda.device(device):
                return _issue_on(engine, lease, leaves, n, events, to_host)
        return _issue_on(engine, lease, leaves, n, events, to_host)


def _issue_on(engine, lease, leaves, n, events, to_host):
    i = lease.turn
    reps = lease.replicas
    rep = reps[i]
    lease.turn = i + 1 if i + 1 < len(reps) else 0
    compute = engine.order_stream(lease.device)
    lease.bucket.count(n)
    ks = lease.key
    dsts = rep.inputs_for(n)
    x = leaves[0]
    if len(leaves) == 1 and not x.is_cuda and x.is_pinned():
        # The common loop: one input in the caller's pinned memory.
        copy_stream = lease.copy_stream
        _wait(rep.replay_done, copy_stream)  # its inputs are free once its last replay is done
        back = lease.back_to(compute)
        lease.to_copy()
        try:
            dsts[0].copy_(x, non_blocking=True)
            _record(rep.copy_done, copy_stream)
        finally:
            back()
        _wait(rep.copy_done, compute)
        read_pinned = True
    else:
        read_pinned = _copy_in(lease, i, rep, dsts, leaves, n, compute)
    rep.graph.replay()
    _record(rep.replay_done, compute)
    if read_pinned:
        # The copy read the caller's pinned memory asynchronously. It is over before this batch's
        # output is yielded and before the iterator runs again, either of which may refill that
        # memory in place (one pinned buffer reused for every batch is a common loop).
        rep.copy_done.synchronize()
    if not to_host and not engine.clone:
        # outputs="view": the static outputs themselves, valid until the next batch is issued
        # (when the caller asks for the next item), as gm(...) views are until the next call.
        return ("gpu", ks.out_spec, rep.outputs_for(n))
    if to_host and rep.out_bytes <= D2H_INLINE_BYTES:
        # Small outputs: copied to the host in stream order right after the replay, before any
        # later replay can overwrite them. That adds a few microseconds of device time and saves
        # a clone and a hop to another stream, which cost more host time than the copy takes.
        return _to_host_inline(ks, rep, n, events, compute)
    # Copied out on the compute stream, right after the replay (into a free slot of the graph's
    # output ring, or clones): graphs share one pool, so a static output can sit in memory that
    # the next replay of another bucket uses for intermediates.
    slot = rep.ring.take(current_stream_id(lease.device.index)) if rep.ring is not None else None
    if slot is not None:
        slot.fill()
        outs = slot.views(n)
    else:
        outs = [o.clone() if t else o for o, t in zip(rep.outputs_for(n), rep.is_tensor)]
    if not to_host:
        return ("gpu", ks.out_spec, outs)
    d2h_stream = lease.d2h_stream
    d2h_stream.wait_stream(compute)
    set_stream(d2h_stream)
    try:
        host = _copies_to_pinned(outs, rep.is_tensor)
        done = events.get()
        done.record(d2h_stream)
    finally:
        set_stream(compute)
    # The clones stay referenced (in the entry) until the host has waited for `done`.
    return ("host", ks.out_spec, host, done, outs)


def _copies_to_pinned(outs, is_tensor):
    """Each tensor of ``outs`` copied into new pinned host memory on the current stream (not
    waited for); the other outputs as they are."""
    host = []
    for o, t in zip(outs, is_tensor):
        if t:
            h = torch.empty(o.shape, dtype=o.dtype, pin_memory=True)
            h.copy_(o, non_blocking=True)
            host.append(h)
        else:
            host.append(o)
    return host


def _to_host_inline(ks, rep, n, events, compute):
    host = _copies_to_pinned(rep.outputs_for(n), rep.is_tensor)
    done = events.get()
    done.record(compute)
    return ("host", ks.out_spec, host, done, None)


def _copy_in(lease, i, rep, dsts, leaves, n, compute) -> bool:
    """Copy a batch into ``rep``'s static inputs on the copy stream, after its last replay.

    Device inputs are copied on the compute stream (in order after whatever made them); host
    inputs on the copy stream, pageable ones through this replica's pinned staging buffers.
    Returns whether the caller's own pinned memory was read.
    """
    on_copy = []
    pageable = read_pinned = False
    for j, (dst, src) in enumerate(zip(dsts, leaves)):
        if src.is_cuda:
            dst.copy_(src)
        else:
            pinned = src.is_pinned()
            pageable = pageable or not pinned
            read_pinned = read_pinned or pinned
            on_copy.append((j, dst, src, pinned))
    if not on_copy:
        return False
    if pageable:
        # This replica's staging buffers are refilled on the host: the copy that read them
        # (two batches ago) must be over.
        rep.copy_done.synchronize()
    copy_stream = lease.copy_stream
    _wait(rep.replay_done, copy_stream)  # the inputs are free once the last replay is done
    set_stream(copy_stream)
    try:
        for j, dst, src, pinned in on_copy:
            if not pinned:
                src = _stage(lease, i, j, rep, src, n)
            dst.copy_(src, non_blocking=True)
        _record(rep.copy_done, copy_stream)
    finally:
        set_stream(compute)
    _wait(rep.copy_done, compute)
    return read_pinned


def _stage(lease, i, j, rep, src, n):
    """Copy a pageable input into this replica's pinned staging buffer (owned by the loop)."""
    bufs = lease.staging.setdefault(i, {})
    buf = bufs.get(j)
    if buf is None:
        full = rep.static_inputs[j]
        buf = bufs[j] = torch.empty(full.shape, dtype=full.dtype, pin_memory=True)
    view = buf.narrow(rep.batch_dim, 0, n)
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
