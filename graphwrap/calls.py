"""The direct call, ``gm(...)``: one call's inputs through the engine's plan, or eagerly.

The common call, one tensor whose shape was seen before, is the plan's ``call1``: a copy, a
replay and the output. A batch above the largest bucket gets a graph of its own size class
(the bucket grid continued, see ``BucketTable.size_for``) when the memory it needs is free:
one large matrix product beats several smaller ones, and eager launches can cost as much host
time as the kernels take. Without that memory, its host inputs are copied to the device once,
chunk by chunk on the engine's copy stream (overlapping the last call's work and each other
chunk's compute), and it runs either as chunks, each replaying its bucket's graph with its
outputs copied into the joined outputs in stream order, or eagerly in one forward; the first
batch of each chunk count times both and keeps the faster. The host waits only for the
copies that read its pinned memory.
"""

import logging
import time

import torch

from .capture import device_sync
from .engine import Engine
from .plans import STALE
from .tree import BATCHED, CONST, Tensor, flatten_outputs, unflatten_inputs

logger = logging.getLogger("graphwrap")
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_event_base = getattr(torch._C, "_CudaEventBase", None)
_wait = getattr(_event_base, "wait", None) or torch.cuda.Event.wait


def call(engine: Engine, args, kwargs):
    """``gm(*args, **kwargs)``."""
    if not kwargs and len(args) == 1:
        x = args[0]
        if type(x) is Tensor:
            plan = engine.fast_plan(x)
            if plan is not None:
                out = plan.call1(x)
                if out is not STALE:
                    return out
    return call_general(engine, args, kwargs)


def call_general(engine: Engine, args, kwargs):
    """``gm(*args, **kwargs)`` once the one-tensor path has not served it."""
    prep = engine.prepare(args, kwargs)
    if type(prep) is str:
        return engine.eager(args, kwargs, prep)
    large = prep[1][1] > engine.table.max
    with engine.lock:  # held across plan and replay: a reset() in between must not be replayed over
        plan = engine.plan(prep)
        if large and (type(plan) is str or plan.reason is not None):
            # No graph of this size (memory): chunks of the largest bucket, or one eager forward.
            return run_chunked(engine, prep, args, kwargs)
        if type(plan) is str:
            return engine.eager(args, kwargs, plan)
        if plan.eager:
            return engine.eager_plan(plan, args, kwargs)
        leaves = prep[1][0]
        if plan.device_index != _current_device():
            with torch.cuda.device(plan.device):
                engine.order_stream(plan.device)
                outs = plan.run(leaves)
        else:
            engine.order_stream(plan.device)
            outs = plan.run(leaves)
    return plan.rebuild(outs)


def run_chunked(engine: Engine, prep, args, kwargs):
    """A batch above the largest bucket without a graph of its own size (the memory it would
    take is not free): replayed in chunks of at most the largest bucket, or run eagerly in one
    forward, whichever was faster the first time this key had a batch of this many chunks
    (timed then, both on the same inputs)."""
    key, (leaves, n, spec, meta, autocast, device) = prep
    with engine.lock:
        ks = engine.key_of(prep)
        if ks is None:
            return engine.eager(args, kwargs, f"more than max_keys={engine.max_keys} input signatures")
        if ks.failed is not None:
            ks.eager_calls += 1
            return engine.eager(args, kwargs, ks.failed)
        chunks = engine.table.chunks(n)
        how = ks.large.get(len(chunks))
        plans = None
        if how != "eager":
            plans = [engine.plan_for_rows(ks, rows, leaves, n) for _, rows, _ in chunks]
            if ks.failed is not None or ks.out_spec is None:
                # The key failed while capturing a chunk's bucket, or no bucket of it was captured.
                return engine.eager(args, kwargs, ks.failed or next(p for p in plans if type(p) is str))
        with torch.cuda.device(device):
            compute = engine.order_stream(device)
            on_device, copied, wait_for, turn = _to_device(engine, ks, leaves, n, chunks, device, compute)
            if how is None:
                how = _decide(engine, ks, on_device, n, chunks, plans, copied, compute)
            if how == "eager":
                if copied is not None:
                    _wait(copied[-1], compute)
                ks.large_eager += 1
                ks.large_rows += n
                out = _eager_whole(engine, ks, on_device)
            else:
                out = ks.out_spec.rebuild(_replay_chunks(engine, ks, on_device, n, chunks, plans, copied, compute))
            _done_with(ks, turn, compute)
            if wait_for is not None:
                # The copies read the caller's pinned memory asynchronously: over before it is handed back.
                wait_for.synchronize()
    return out


def _eager_whole(engine, ks, on_device):
    args, kwargs = unflatten_inputs(ks.in_spec, on_device)
    with torch.no_grad():
        return engine.eager_run(args, kwargs)


def _decide(engine, ks, on_device, n, chunks, plans, copied, compute) -> str:
    """Time the chunked replays and one eager forward on these inputs; remember the faster."""
    if copied is not None:
        _wait(copied[-1], compute)
    if not engine.eager_if_faster or any(type(p) is str or p.eager for p in plans):
        how = "graph"
    else:
        counts = [p.calls for p in plans]  # the timing runs are not calls: stats leave them out
        times = {"graph": [], "eager": []}
        for _ in range(2):
            for name in times:
                device_sync()
                t0 = time.perf_counter()
                if name == "graph":
                    _replay_chunks(engine, ks, on_device, n, chunks, plans, None, compute)
                else:
                    _eager_whole(engine, ks, on_device)
                device_sync()
                times[name].append(time.perf_counter() - t0)
        for p, c in zip(plans, counts):
            p.calls = c
        g, e = min(times["graph"]), min(times["eager"])
        how = "eager" if e <= g else "graph"
        logger.info("graphwrap: batches of %d chunks of %s run %s: %d chunked replays took %.3f ms, one eager "
                    "forward %.3f ms (batch of %d)", len(chunks), ks.label,
                    "eagerly" if how == "eager" else "as chunked replays", len(chunks), 1e3 * g, 1e3 * e, n)
    ks.large[len(chunks)] = how
    return how


def _replay_chunks(engine, ks, on_device, n, chunks, plans, copied, compute):
    bd = engine.batch_dim
    joined = None
    for i, ((start, rows, _), plan) in enumerate(zip(chunks, plans)):
        if copied is not None:
            _wait(copied[i], compute)
        part = [t.narrow(bd, start, rows) for t in on_device]
        if type(plan) is str or plan.eager:
            p_args, p_kwargs = unflatten_inputs(ks.in_spec, part)
            with torch.no_grad():
                if type(plan) is str:
                    out = engine.eager(p_args, p_kwargs, plan)
                else:
                    out = engine.eager_plan(plan, p_args, p_kwargs)
            outs = flatten_outputs(out)[0]
        else:
            outs = plan.run(part, clone=False)
        if joined is None:
            joined = []
            for o, kind in zip(outs, ks.kinds):
                if kind == BATCHED:
                    shape = list(o.shape)
                    shape[bd] = n
                    joined.append(o.new_empty(shape))
                elif kind == CONST:
                    joined.append(o)
                else:
                    joined.append(o.clone())
        for j, (o, kind) in enumerate(zip(outs, ks.kinds)):
            if kind == BATCHED:
                joined[j].narrow(bd, start, rows).copy_(o)
    return joined


class Staging:
    """Device buffers for one key's large host batches, two sets taken in turns.

    The copy into a set waits until the compute stream is done with what that set held two
    calls ago, and the call waits for its copies before it returns: so the host runs at most
    two calls ahead of the device, and memory stays flat however far ahead it could issue.
    """

    __slots__ = ("bufs", "done", "turn")

    def __init__(self):
        self.bufs = [None, None]  # per turn: host leaf index -> device buffer
        self.done = [None, None]  # per turn: recorded on the compute stream after the last reads
        self.turn = 0


def _to_device(engine, ks, leaves, n, chunks, device, compute):
    """The inputs on the device: host tensors copied chunk by chunk on the copy stream into
    the key's staging buffers.

    Returns the device tensors, one event per chunk (its copies are done; None if every input
    was on the device already), the event to wait for before returning (None unless the
    caller's pinned memory was read asynchronously) and the staging turn used (or None).
    """
    host = [i for i, t in enumerate(leaves) if not t.is_cuda]
    if not host:
        return leaves, None, None, None
    bd = engine.batch_dim
    st = ks.staging
    if st is None:
        st = ks.staging = Staging()
    turn = st.turn
    st.turn = 1 - turn
    bufs = st.bufs[turn] or {}
    copy_stream = engine.copy_stream(device)
    fresh = False
    for i in host:
        t, b = leaves[i], bufs.get(i)
        if b is None or b.dtype != t.dtype or b.shape[bd] < n or b.shape[:bd] + b.shape[bd + 1:] != \
                t.shape[:bd] + t.shape[bd + 1:]:
            bufs[i] = torch.empty(t.shape, dtype=t.dtype, device=device)
            fresh = True
    st.bufs[turn] = bufs
    if fresh:
        # New memory from the compute stream's pool: whatever that stream did with it before
        # comes first.
        copy_stream.wait_stream(compute)
    elif st.done[turn] is not None:
        _wait(st.done[turn], copy_stream)
    out = list(leaves)
    for i in host:
        out[i] = bufs[i].narrow(bd, 0, n)
    events = [torch.cuda.Event() for _ in chunks]
    pinned = False
    with torch.cuda.stream(copy_stream):
        for (start, rows, _), ev in zip(chunks, events):
            for i in host:
                out[i].narrow(bd, start, rows).copy_(leaves[i].narrow(bd, start, rows), non_blocking=True)
            ev.record(copy_stream)
    pinned = any(leaves[i].is_pinned() for i in host)
    return out, events, events[-1] if pinned else None, turn


def _done_with(ks, turn, compute):
    """Mark the staging buffers of ``turn`` read: the compute stream has issued its last use."""
    if turn is not None:
        ev = ks.staging.done[turn]
        if ev is None:
            ev = ks.staging.done[turn] = torch.cuda.Event()
        ev.record(compute)
