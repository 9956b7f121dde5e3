"""The direct call, ``gm(...)``: one call's inputs through the engine's plan, or eagerly.

The common call, one tensor whose shape was seen before, is the plan's ``call1``, taken by
``Engine.call`` before this loop: a copy, a replay and the output. A batch above the largest bucket of its length gets a graph of its own
size class (the bucket grid continued, see ``BucketTable.size_for``) when the memory it needs
is free; without that memory (and always for inputs with a sequence dimension, whose largest
bucket is set by the token budget), it is served in chunks of at most the largest bucket, each a
replay, or eagerly in one forward, whichever was faster the first time a batch of that many
chunks came. Its host inputs are copied once, chunk by chunk on the engine's copy stream, so
the copies overlap the replays; the host waits only for the copies that read its pinned memory.
"""

import logging
import time
from typing import Dict, List

import torch

from ..core.plans import STALE
from ..core.reasons import DROPPED, NOT_CAPTURED, Eager, capture_reason
from ..core.tree import BATCHED, CONST, unflatten_inputs

logger = logging.getLogger("graphwrap")


def call_general(engine, args, kwargs):
    """``gm(*args, **kwargs)`` once the one-tensor path has not served it."""
    f = engine.facts(args, kwargs)
    if type(f) is Eager:
        return engine.eager(args, kwargs, f)
    for _ in range(3):  # a reset() between plan and replay: plan again
        out = call_plan(engine, engine.plan(f), f.leaves, args, kwargs)
        if out is not STALE:
            return out
    return engine.eager(args, kwargs, DROPPED)


def call_plan(engine, plan, leaves, args, kwargs):
    """What ``plan`` says for a call: chunks, eager, or copy in, replay and outputs out."""
    if plan.chunked:
        return run_chunked(engine, plan, leaves, args, kwargs)
    if plan.eager:
        return engine.eager_plan(plan, args, kwargs)
    outs = engine.run(plan, leaves)
    return outs if outs is STALE else plan.rebuild(outs)


def run_chunked(engine, plan, leaves, args, kwargs):
    """A batch above the largest bucket of its length, in chunks or in one eager forward."""
    ks, n, L = plan.key, plan.n, plan.L
    S = engine.grid.seq_for(L, exact=ks.exact is not None) if ks.has_seq else None
    chunks = engine.grid.chunks(n, S)
    how = ks.large.get(len(chunks))
    plans = None
    if how != "eager":
        plans = [engine.plan_rows(ks, rows, L, _rows(leaves, ks.roles, start, rows)) for start, rows, _ in chunks]
        if ks.failed is not None or ks.out_spec is None:
            why = capture_reason(ks.failed) if ks.failed is not None else None
            return engine.eager(args, kwargs, why or next((p.reason for p in plans if p.reason), NOT_CAPTURED))
    device = ks.device
    staged = _to_device(engine, ks, leaves, n, chunks, device)
    if how is None:
        how = _decide(engine, ks, staged, n, chunks, plans)
    if how == "eager":
        with engine.lock:
            staged.wait_all()
        engine.served_large(ks, n)
        a, k = unflatten_inputs(ks.spec, staged.leaves)
        out = engine.eager_run(a, k)
    else:
        with engine.lock:
            outs = _replay_chunks(engine, ks, staged, n, chunks, plans)
        out = ks.out_spec.rebuild(outs)
    staged.finish()
    return out


def _rows(leaves, roles, start, rows):
    return [t if bd is None else t.narrow(bd, start, rows) for t, (bd, _, _) in zip(leaves, roles)]


def _decide(engine, ks, staged, n, chunks, plans) -> str:
    """Time the chunked replays and one eager forward on these inputs; remember the faster."""
    if not engine.eager_if_faster or any(p.eager for p in plans):
        how = "graph"
    else:
        counts = [p.calls for p in plans]  # the timing runs are not calls: stats leave them out
        a, k = unflatten_inputs(ks.spec, staged.leaves)
        times: Dict[str, List[float]] = {"graph": [], "eager": []}
        for _ in range(2):
            for name in times:
                engine.backend.sync()
                t0 = time.perf_counter()
                if name == "graph":
                    with engine.lock:
                        _replay_chunks(engine, ks, staged, n, chunks, plans)
                else:
                    with torch.no_grad():
                        engine.eager_run(a, k)
                engine.backend.sync()
                times[name].append(time.perf_counter() - t0)
        for p, c in zip(plans, counts):
            p.calls = c
        g, e = min(times["graph"]), min(times["eager"])
        how = "eager" if e <= g else "graph"
        logger.info("batches of %d chunks of %s run %s: %d chunked replays took %.3f ms, one eager "
                    "forward %.3f ms (batch of %d)", len(chunks), ks.label,
                    "eagerly" if how == "eager" else "as chunked replays", len(chunks), 1e3 * g, 1e3 * e, n)
    engine.chose_large(ks, len(chunks), how)
    return how


def _replay_chunks(engine, ks, staged, n, chunks, plans):
    """Each chunk replayed and its outputs copied into the joined outputs, in stream order. The
    caller holds the lock (the static outputs are read before any other replay)."""
    bd = engine.batch_dim
    compute = staged.order(engine)
    joined = None
    for i, ((start, rows, _), plan) in enumerate(zip(chunks, plans)):
        staged.wait(i, compute)
        part = _rows(staged.leaves, ks.roles, start, rows)
        if plan.eager:
            from ..core.tree import flatten_outputs
            a, k = unflatten_inputs(ks.spec, part)
            outs = flatten_outputs(engine.eager_plan(plan, a, k))[0]
        else:
            outs = plan.run(part, clone=False)
        if joined is None:
            joined = [_joined(o, kind, bd, n) for o, kind in zip(outs, ks.kinds)]
        for j, (o, kind) in enumerate(zip(outs, ks.kinds)):
            if kind == BATCHED:
                joined[j].narrow(bd, start, rows).copy_(o)
    staged.read(compute)
    return joined


def _joined(o, kind, bd, n):
    if kind == BATCHED:
        shape = list(o.shape)
        shape[bd] = n
        return o.new_empty(shape)
    return o if kind == CONST else o.clone()


class _Staged:
    """A large batch's inputs on the device: host ones copied chunk by chunk on the copy stream
    into the key's staging buffers (one event per chunk)."""

    def __init__(self, leaves, events=None, stager=None, turn=None, pinned=None):
        self.leaves, self.events, self.stager, self.turn, self.pinned = leaves, events, stager, turn, pinned

    def order(self, engine):
        device = self.leaves[0].device
        return engine.order_stream(device) if device.type == "cuda" else None

    def wait(self, i, compute):
        if self.events is not None:
            compute.wait_event(self.events[i])

    def wait_all(self):
        if self.events is not None:
            torch.cuda.current_stream(self.leaves[0].device).wait_event(self.events[-1])

    def read(self, compute):
        if self.stager is not None:
            self.stager.done(self.turn, compute)

    def finish(self):
        if self.pinned is not None:
            # The copies read the caller's pinned memory asynchronously: over before it is handed back.
            self.pinned.synchronize()


def _to_device(engine, ks, leaves, n, chunks, device) -> _Staged:
    host = [i for i, t in enumerate(leaves) if t.device != device]
    if not host or device.type != "cuda":
        return _Staged(leaves)
    st = engine.staging(ks)
    turn = st.take()
    copy_stream = engine.copy_stream(device)
    out = list(leaves)
    fresh = False
    for i in host:
        t, bd = leaves[i], ks.roles[i][0]
        out[i], new = st.buffer(turn, i, t.shape, t.dtype, bd if bd is not None else 0)
        fresh = fresh or new
    compute = torch.cuda.current_stream(device)
    if fresh:  # new memory from the compute stream's pool: whatever that stream did with it comes first
        copy_stream.wait_stream(compute)
    else:
        st.wait_stream(turn, copy_stream)
    events = [torch.cuda.Event() for _ in chunks]
    with torch.cuda.stream(copy_stream):
        for (start, rows, _), ev in zip(chunks, events):
            for i in host:
                bd = ks.roles[i][0]
                if bd is None:
                    if start == 0:
                        out[i].copy_(leaves[i], non_blocking=True)
                else:
                    out[i].narrow(bd, start, rows).copy_(leaves[i].narrow(bd, start, rows), non_blocking=True)
            ev.record(copy_stream)
    pinned = any(leaves[i].is_pinned() for i in host)
    return _Staged(out, events, st, turn, events[-1] if pinned else None)
