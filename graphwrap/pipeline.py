"""The inference loop: host-to-device copies on a copy stream, hidden behind graph replays.

Per batch, with two graphs per bucket (A and B) taking turns:

    copy stream     wait(A replayed) -> copy inputs into A -> record A.copy_done
    compute stream  wait(A.copy_done) -> replay A -> record A.replay_done -> clone outputs
    d2h stream      wait(clones made) -> copy them to pinned host -> record (to_host only)

so the copy for the next batch (into B) runs while A replays. The host never waits in the
steady state, except with ``to_host=True``, where a batch is yielded only once its host
copy is complete (two batches behind the newest one issued, so the wait is usually over).
"""

import collections
from typing import Any, Iterable, Iterator

import torch

from .errors import GraphwrapError
from .tree import Tensor, map_tensors

LEASED = 2  # graphs per bucket a loop takes turns on
HOST_LAG = 2  # with to_host, batches issued ahead of the one yielded


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
    """The replicas one loop takes turns on for one bucket, and its pinned staging buffers."""

    __slots__ = ("replicas", "turn", "staging")

    def __init__(self, replicas):
        self.replicas = replicas
        self.turn = 0
        self.staging = {}  # replica index -> pinned buffers for pageable inputs


class _EventPool:
    def __init__(self):
        self.free = []

    def get(self):
        return self.free.pop() if self.free else torch.cuda.Event()

    def put(self, ev):
        self.free.append(ev)


def run_pipeline(gm, batches: Iterable[Any], to_host: bool = False) -> Iterator[Any]:
    it = iter(batches)
    pending = collections.deque()
    leases = {}
    events = _EventPool()
    streams = {}
    lag = HOST_LAG if to_host else 0
    try:
        for item in it:
            args, kwargs = as_call(item)
            prep = gm._prepare(args, kwargs)
            entry = None
            if type(prep) is not str:
                entry = _issue(gm, prep, leases, streams, events, to_host)
            if entry is None:
                # Eager, a failed capture, or a batch above the largest bucket: gm() serves it,
                # in order on the caller's stream.
                out = gm(*args, **kwargs)
                if to_host:
                    out = map_tensors(_to_pinned_host, out)
                entry = ("done", out)
            pending.append(entry)
            while len(pending) > lag:
                yield _finish(pending.popleft(), events)
        while pending:
            yield _finish(pending.popleft(), events)
    finally:
        # Leave no copy in flight on memory this loop owns or is about to drop.
        for copy_stream, d2h_stream in streams.values():
            copy_stream.synchronize()
            d2h_stream.synchronize()
        for entry in pending:
            if entry[0] == "host":
                entry[3].synchronize()
        with gm._gw_lock:
            for lease in leases.values():
                gm._return_lease(lease.replicas)


def _streams(streams, device):
    """The loop's copy stream and device-to-host stream on ``device``."""
    s = streams.get(device)
    if s is None:
        s = streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return s


def _issue(gm, prep, leases, streams, events, to_host):
    """Issue one batch's copies, replay and output copies; None if gm(...) must serve it."""
    key, (leaves, n, spec, meta, autocast, device) = prep
    with gm._gw_lock:
        ks = gm._gw_store.keys.get(key) or gm._key_for(key, spec, meta, autocast, device, leaves)
        if ks is None or ks.failed is not None or n > gm._gw_table.max:
            return None
        size = gm._gw_table.bucket_for(n)
        lease = leases.get((id(ks), size))
        if lease is None:
            reps = gm._take_lease(ks, size, leaves, n, LEASED)
            if reps is None:
                return None
            lease = leases[(id(ks), size)] = _Lease(reps)
        if device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                return _issue_on(gm, ks, lease, size, leaves, n, device, streams, events, to_host)
        return _issue_on(gm, ks, lease, size, leaves, n, device, streams, events, to_host)


def _issue_on(gm, ks, lease, size, leaves, n, device, streams, events, to_host):
    i = lease.turn
    lease.turn = (i + 1) % len(lease.replicas)
    rep = lease.replicas[i]
    copy_stream, d2h_stream = _streams(streams, device)
    compute = gm._order_stream(device)
    b = ks.buckets[size]
    b.replays += 1
    b.rows += n
    b.padded_rows += size - n
    dsts = rep.inputs_for(n)
    on_copy = []
    pageable = False
    for j, (dst, src) in enumerate(zip(dsts, leaves)):
        if src.is_cuda:
            dst.copy_(src)  # device to device: on the compute stream, in order after src is made
        else:
            pinned = src.is_pinned()
            pageable = pageable or not pinned
            on_copy.append((j, dst, src, pinned))
    if on_copy:
        if rep.copy_done is None:
            rep.copy_done = torch.cuda.Event()
            copy_stream.wait_stream(compute)
        elif pageable:
            # This replica's staging buffers are refilled on the host: the copy that read them
            # (two batches ago) must be over.
            rep.copy_done.synchronize()
        if rep.replay_done is not None:
            copy_stream.wait_event(rep.replay_done)  # the inputs are free once the last replay is done
        torch.cuda.set_stream(copy_stream)
        try:
            for j, dst, src, pinned in on_copy:
                if not pinned:
                    src = _stage(lease, i, j, rep, src, n)
                dst.copy_(src, non_blocking=True)
            rep.copy_done.record(copy_stream)
        finally:
            torch.cuda.set_stream(compute)
        compute.wait_event(rep.copy_done)
    rep.graph.replay()
    if rep.replay_done is None:
        rep.replay_done = torch.cuda.Event()
    rep.replay_done.record(compute)
    if not to_host and not gm._gw_clone:
        # outputs="view": the static outputs themselves, valid until the next batch is issued
        # (when the caller asks for the next item), as gm(...) views are until the next call.
        return ("gpu", ks.out_spec, rep.outputs_for(n))
    # Clone on the compute stream, right after the replay: graphs share one pool, so a static
    # output can sit in memory that the next replay of another bucket uses for intermediates.
    outs = [o.clone() if t else o for o, t in zip(rep.outputs_for(n), rep.is_tensor)]
    if not to_host:
        return ("gpu", ks.out_spec, outs)
    d2h_stream.wait_stream(compute)
    host = []
    torch.cuda.set_stream(d2h_stream)
    try:
        for o in outs:
            if isinstance(o, Tensor):
                h = torch.empty(o.shape, dtype=o.dtype, pin_memory=True)
                h.copy_(o, non_blocking=True)
                host.append(h)
            else:
                host.append(o)
        done = events.get()
        done.record(d2h_stream)
    finally:
        torch.cuda.set_stream(compute)
    # The clones stay referenced (in the entry) until the host has waited for `done`.
    return ("host", ks.out_spec, host, done, outs)


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
