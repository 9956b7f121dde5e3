"""What the engine keeps per input signature and batch size, and what one call runs.

A :class:`Key` is one input signature (its buckets, plans and output structure); a
:class:`Bucket` one batch size of it (its captured graphs and what they cost and served); a
:class:`Plan` what one call of ``n`` rows does, worked out once: copy in, replay, outputs out.
The engine (``graphwrap.engine``) makes and swaps them; the loops run plans.
"""

from typing import Any, Dict, List, Optional

import torch

from .capture import Replica

Tensor = torch.Tensor
# (stream id, device index, device type) of the current stream, without building a Stream.
current_stream_id = getattr(torch._C, "_cuda_getCurrentStream", None)
STALE = object()  # what Plan.call1 returns when its graphs were dropped meanwhile


class Bucket:
    """One batch size of one key: its graphs, what it cost and what it served."""

    __slots__ = ("size", "replicas", "leased", "failed", "over_budget", "replays", "rows", "padded_rows",
                 "eager_calls", "capture_s", "verify_s", "pool_bytes", "pool_estimate", "compiled", "compile_s",
                 "compiled_graphs", "serves", "graph_us", "eager_us", "forward", "kernels", "tuned", "shared_us",
                 "per_size_us")

    def __init__(self, size):
        self.size = size
        self.replicas: List[Replica] = []  # [0] serves gm(...); the others are leased to loops
        self.leased = set()
        self.failed: Optional[str] = None
        self.over_budget = False  # not captured for the pool budget: a larger bucket serves its batches
        # Counters of the loops that replay leased graphs; plans count their own calls.
        self.replays = self.rows = self.padded_rows = self.eager_calls = 0
        self.capture_s = self.verify_s = self.compile_s = 0.0
        self.pool_bytes = 0
        self.pool_estimate = 0  # with max_pool_bytes: the pool growth estimated before capture
        self.compiled: Optional[bool] = None  # runs Inductor's kernels (None: compile not asked)
        self.compiled_graphs = 0
        self.serves = "graph"  # or "eager", when eager measured faster at capture
        self.graph_us = self.eager_us = None
        self.forward = None  # the CompiledForward its graphs captured, or None
        self.kernels: Optional[str] = None  # "shared" (one compile for every bucket) or "per-size"
        self.tuned = False  # the tuner has had it (see graphwrap.tuning)
        self.shared_us = self.per_size_us = None  # replay times the tuner measured

    def count(self, n: int):
        """One replay of ``n`` real rows by a loop that holds a leased graph."""
        self.replays += 1
        self.rows += n
        self.padded_rows += self.size - n


class Key:
    """One input signature: its buckets, plans and output structure."""

    __slots__ = ("label", "in_spec", "device", "autocast", "kinds", "out_spec", "buckets", "failed",
                 "eager_calls", "seen_as", "plans", "single", "join", "join_refused", "large", "large_eager",
                 "large_rows", "staging", "warming", "warming_calls")

    def __init__(self, label, in_spec, device, autocast, seen_as, single):
        self.label = label
        # The inputs as the captured forward sees them (its static inputs: every tensor on the
        # module's device). Keys that differ only in where the caller's tensors are share it,
        # and with it torch.compile's compiled code.
        self.seen_as = seen_as
        self.in_spec = in_spec
        self.device = device
        self.autocast = autocast
        self.kinds = None
        self.out_spec = None
        self.buckets: Dict[int, Bucket] = {}
        self.failed: Optional[str] = None
        self.eager_calls = 0
        self.plans: Dict[int, "Plan"] = {}  # batch size -> plan
        self.single = single  # (dtype, device index) for a lone tensor input without autocast, else None
        # For the batcher: (output kinds, output spec) once a probe showed that requests joined
        # along the batch get what each gets alone; or why they must not be joined.
        self.join = None
        self.join_refused: Optional[str] = None
        # Batches above the largest bucket, by number of chunks: "graph" (chunks replayed) or
        # "eager" (one forward), whichever was faster when first timed; and calls served eagerly.
        self.large: Dict[int, str] = {}
        self.large_eager = self.large_rows = 0
        self.staging = None  # the direct call's device buffers for large host batches (graphwrap.calls)
        self.warming = False  # a background capture runs: calls of uncaptured buckets run eagerly
        self.warming_calls = 0


class Plan:
    """What one call of ``n`` rows of one key does, built once: copy in, replay, outputs out.

    An ``eager`` plan runs the module instead: its bucket measured eager faster (``reason``
    None) or could not be captured (``reason`` says why).
    """

    __slots__ = ("engine", "key", "bucket", "n", "size", "replay", "inputs", "outputs", "is_tensor",
                 "clone", "single_out", "rebuild", "eager", "reason", "calls", "device", "device_index",
                 "input", "output", "dtype", "dev", "epoch", "ring")

    def __init__(self, engine, key: Key, n: int, bucket: Bucket, reason: Optional[str] = None, eager: bool = False):
        self.engine = engine
        self.epoch = engine.epoch
        self.key = key
        self.bucket = bucket
        self.n = n
        self.size = bucket.size
        self.calls = 0
        self.device = key.device
        self.device_index = key.device.index
        self.dtype, self.dev = key.single if key.single is not None else (None, None)
        self.clone = engine.clone
        self.rebuild = key.out_spec.rebuild if key.out_spec is not None else None
        self.reason = reason
        self.eager = eager or reason is not None or bucket.serves == "eager"
        if self.eager:
            self.replay = self.inputs = self.outputs = self.is_tensor = self.input = self.output = None
            self.single_out = False
            self.ring = None
            return
        rep = bucket.replicas[0]
        self.ring = rep.ring if self.clone else None
        self.replay = rep.graph.replay
        self.inputs = rep.inputs_for(n)
        self.outputs = rep.outputs_for(n)
        self.is_tensor = rep.is_tensor
        self.input = self.inputs[0]
        self.output = self.outputs[0]
        self.single_out = key.out_spec.single and rep.is_tensor[0]

    def call1(self, x: Tensor):
        """``gm(x)`` for one tensor: the whole per-call work of the common case; ``STALE`` if
        the graphs were dropped since the plan was taken (the caller takes the general path)."""
        eng = self.engine
        if self.eager:
            return eng.eager_plan(self, (x,), {})
        with eng.lock:
            if self.epoch != eng.epoch:
                return STALE
            sid = current_stream_id(self.device_index)
            if sid != eng.last_sid:
                eng.order_stream(self.device)
            self.input.copy_(x)
            self.replay()
            self.calls += 1
            if not self.clone:
                if self.single_out:
                    return self.output
                outs = self.outputs
            else:
                slot = self.ring.take(sid) if self.ring is not None else None
                if slot is not None:
                    slot.fill()
                    outs = slot.views(self.n)
                    if self.single_out:
                        return outs[0]
                elif self.single_out:
                    return self.output.clone()
                else:
                    outs = [o.clone() if t else o for o, t in zip(self.outputs, self.is_tensor)]
        return self.rebuild(outs)

    def run(self, leaves, clone: bool = True) -> List[Any]:
        """Copy ``leaves`` in and replay; the flat outputs, owned with ``outputs="clone"`` unless
        ``clone`` is False (views of the static outputs, valid until the next replay). The
        caller holds the engine's lock and has ordered the stream (:meth:`Engine.order_stream`)."""
        for dst, src in zip(self.inputs, leaves):
            dst.copy_(src)
        self.replay()
        self.calls += 1
        if clone and self.clone:
            return self.owned()
        return self.outputs

    def owned(self) -> List[Any]:
        """The static outputs copied into memory the caller owns: a free slot of the ring if
        there is one, else clones. The caller holds the lock and issues on the current stream."""
        ring = self.ring
        if ring is not None:
            slot = ring.take(current_stream_id(self.device_index))
            if slot is not None:
                slot.fill()
                return slot.views(self.n)
        return [o.clone() if t else o for o, t in zip(self.outputs, self.is_tensor)]
