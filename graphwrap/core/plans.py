"""What one call runs, worked out once per key and size: copy in, replay, outputs out.

A :class:`Plan` holds, for ``n`` rows and length ``L`` of one key, the views its inputs are
copied into, the pad fills, the replay, the cut-back outputs and their rebuild, so a call is
those and nothing else. An ``eager`` plan runs the module instead: its bucket measured eager
faster (``reason`` None) or cannot be served by a graph (``reason`` says why).
"""

from typing import Any, Callable, List, Optional

import torch

from ..capture.slots import owned
from ..loops.staging import HOST_COPY_BYTES, DeviceCopy, HostCopy
from .reasons import Eager
from .records import Bucket, Graph, Key, tally

Tensor = torch.Tensor
# (stream id, device index, device type) of the current stream, without building a Stream.
# None on a torch built without CUDA (then no plan's device is "cuda").
cuda_sid: Callable[[int], Any] = getattr(torch._C, "_cuda_getCurrentStream", None)  # type: ignore[assignment]
STALE = object()  # what Plan.call1 returns when its graphs were dropped meanwhile
_grad_on = torch.is_grad_enabled
NO_BUCKET = Bucket(0)  # the bucket of a plan that serves no bucket (eager, chunked)


def no_stream(_index):
    return None


class Plan:
    """One call of ``n`` rows (length ``L``) of one key, built once."""

    __slots__ = ("engine", "key", "bucket", "graph", "n", "L", "size", "replay", "dsts", "pads", "outputs",
                 "is_tensor", "clone", "single_out", "rebuild", "eager", "chunked", "reason", "calls", "device",
                 "device_index", "input", "output", "dtype", "dev", "epoch", "ring", "sid", "tune_at", "held_eager",
                 "host_in")
    # What a plan that replays holds. An eager or chunked plan holds None in each (it returns
    # before it would read them).
    graph: Graph
    replay: Callable[[], None]
    dsts: list
    pads: list
    outputs: List[Tensor]
    is_tensor: List[bool]
    input: Tensor
    output: Tensor
    rebuild: Callable[[List[Any]], Any]  # the key's output structure from flat outputs

    def __init__(self, engine, key: Optional[Key], n: int, L: Optional[int], bucket: Bucket,
                 reason: Optional[Eager] = None, eager: bool = False, graph: Optional[Graph] = None,
                 chunked: bool = False):
        self.engine, self.key, self.bucket, self.n, self.L = engine, key, bucket, n, L
        self.epoch = engine.epoch
        self.size = bucket.size
        self.calls = 0
        self.reason = reason
        self.tune_at = -1  # calls after which the engine is told this bucket is hot (compile tuning)
        self.chunked = chunked  # above the largest bucket of its length: served in chunks (graphwrap.loops.calls)
        self.eager = not chunked and (eager or reason is not None or not bucket.graphs)
        self.clone = engine.clone
        device = key.device if key is not None else torch.device("cpu")
        self.device = device
        self.device_index = device.index if device.index is not None else -1
        self.sid = cuda_sid if device.type == "cuda" and cuda_sid is not None else no_stream
        self.dtype, self.dev = key.single if key is not None and key.single is not None else (None, None)
        self.rebuild = key.out_spec.rebuild if key is not None and key.out_spec is not None else None  # type: ignore[assignment]
        if self.eager or chunked:
            self.graph = self.replay = self.dsts = self.pads = self.outputs = self.is_tensor = None  # type: ignore[assignment]
            self.input = self.output = self.ring = self.host_in = None  # type: ignore[assignment]
            self.single_out = self.held_eager = False
            return
        g = self.graph = graph if graph is not None else bucket.graphs[0]
        self.ring = g.ring if self.clone else None
        # Every slot held (the caller keeps its outputs): one eager forward where the race found
        # it faster than a replay and a clone (a model of a kernel or two). The bucket's fill of
        # the pad rows is no concern there: eager runs the call's own rows.
        self.held_eager = bucket.eager_when_held and self.ring is not None
        self.replay = g.replay
        self.dsts, self.pads = g.inputs_for(n, L)
        self.outputs = g.outputs_for(n, L)
        self.is_tensor = g.is_tensor
        self.input = self.dsts[0]
        self.output = self.outputs[0]
        self.single_out = key is not None and key.out_spec is not None and key.out_spec.single and g.is_tensor[0]
        # gm(x) with x in host memory: copied so that the call never waits for the replay before
        # it (graphwrap.loops.staging): small ones through pinned buffers of the plan's own, larger
        # ones through device buffers of the graph's own, on the copy stream.
        self.host_in = None
        if key is not None and key.host and key.single is not None and device.type == "cuda" and L is None:
            if self.input.numel() * self.input.element_size() <= HOST_COPY_BYTES:
                self.host_in = HostCopy()
            else:
                if g.host_in is None:
                    g.host_in = DeviceCopy(g.static_inputs[0], g.roles[0][0])
                self.host_in = g.host_in

    @classmethod
    def eager_only(cls, engine, reason: Eager) -> "Plan":
        """A plan that runs the module for ``reason``, for a call that has no key."""
        return cls(engine, None, 0, None, NO_BUCKET, reason=reason)

    def call1(self, x: Tensor):
        """``gm(x)`` for one tensor: the whole per-call work of the common case; ``STALE`` if
        the graphs were dropped since the plan was taken (the caller takes the general path)."""
        eng = self.engine
        if self.eager:
            return eng.eager_plan(self, (x,), {})
        grow = False
        with eng.lock:
            if self.epoch != eng.epoch:
                return STALE
            sid = self.sid(self.device_index)
            if sid != eng.last_sid:
                eng.order_stream(self.device)
            if not self.clone:
                self.copy1(x)
                self.calls += 1
                if self.calls == self.tune_at:
                    eng.capturer.hot()
                self.replay()
                if self.single_out:
                    return self.output
                outs = self.outputs
            else:
                ring = self.ring
                slot = ring.take(sid) if ring is not None else None
                if slot is None and self.held_eager and ring is not None:
                    self.bucket.eager_held_calls += 1
                    outs = None
                    ring.want()
                    grow = ring.claim()
                else:
                    self.copy1(x)
                    self.calls += 1
                    if self.calls == self.tune_at:
                        eng.capturer.hot()
                    outs = owned(self.graph, slot, self.outputs, self.n, self.L)
                    grow = slot is None and ring is not None and ring.claim()
        if grow:  # every slot was held: another is made, off the lock
            eng.grow(self.graph)
        if outs is None:  # x is on the module's device and needs no grad (fast_plan checked both)
            if _grad_on():
                with torch.no_grad():
                    return eng.module(x)
            return eng.module(x)
        return outs[0] if self.single_out else self.rebuild(outs)

    def copy1(self, x: Tensor):
        """Copy ``x`` into the static input; a host tensor through ``host_in``. The caller holds
        the lock and has ordered the stream."""
        h = self.host_in
        if h is not None and not x.is_cuda:
            h.copy(self.input, x, self.engine)
        else:
            self.input.copy_(x)

    def run(self, leaves, clone: bool = True) -> List[Any]:
        """Copy ``leaves`` in and replay; the flat outputs, owned with ``outputs="clone"`` unless
        ``clone`` is False (views of the static outputs, valid until the next replay). The
        caller holds the engine's lock and has ordered the stream (``Engine.order_stream``)."""
        self.graph.write(self.dsts, self.pads, leaves, self.L)
        self.calls += 1
        if self.calls == self.tune_at:
            self.engine.capturer.hot()
        if not (clone and self.clone):
            self.replay()
            return self.outputs
        slot = self.ring.take(self.sid(self.device_index)) if self.ring is not None else None
        return owned(self.graph, slot, self.outputs, self.n, self.L)


def plan_tally(plan) -> list:
    """The counts (``records.COUNTS``) of the calls a plan has served."""
    return tally(plan.bucket, plan.calls, plan.n, plan.L, plan.eager, plan.reason is None)


def fold(engine, ks: Key, b: Optional[Bucket]):
    """Drop the plans of bucket ``b`` (every plan of ``ks`` if None), their counts kept in
    their buckets; plans are made again on the next calls. The caller holds the lock."""
    for key, plan in list(ks.plans.items()):
        if b is not None and plan.bucket is not b:
            continue
        pb = plan.bucket
        if plan.calls and pb.size:
            pb.absorb(plan_tally(plan))
        plan.epoch = -1  # stale for whoever holds it (loops.repeat): its next run goes the general way
        del ks.plans[key]
    for shape, plan in list(engine.fast.items()):
        if plan.key is ks and (b is None or plan.bucket is b):
            del engine.fast[shape]
