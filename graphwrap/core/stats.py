"""What ``stats()`` reports, read off the engine's records (the caller holds the engine's lock)."""

from typing import Optional

from .plans import plan_tally
from .records import COUNTS, Bucket, Key, Serves


def _name(b: Bucket):
    return b.size if b.seq is None else f"{b.size}x{b.seq}"


def counts_of(ks: Key) -> dict:
    """Per bucket: replays, rows, padded rows, tokens, padded tokens, eager calls; the bucket's
    own counts (leased graphs, folded plans) plus those of its plans."""
    counts = {id(b): [getattr(b, name) for name in COUNTS] for b in ks.buckets.values()}
    for plan in ks.plans.values():
        c = counts.get(id(plan.bucket))
        if c is not None and plan.calls:
            c[:] = [x + y for x, y in zip(c, plan_tally(plan))]
    return counts


def bucket_stats(b: Bucket, c) -> dict:
    replays, rows, padded, tokens, padded_tokens, eager_calls = c
    return {
        "batch": b.size, "seq": b.seq,
        "captured": bool(b.graphs), "graphs": len(b.graphs),
        "serves": "graph" if b.serves is Serves.GRAPH else "eager",
        "state": b.serves.value,
        "failed": b.reason if b.serves in (Serves.FAILED, Serves.OVER_BUDGET) else None,
        "over_budget": b.serves is Serves.OVER_BUDGET,
        "compiled": b.compiled, "compiled_graphs": b.compiled_graphs, "kernels": b.kernels,
        "shared_us": b.shared_us, "per_size_us": b.per_size_us, "compile_s": b.compile_s,
        "graph_us": b.graph_us, "eager_us": b.eager_us, "held_us": b.held_us,
        "eager_when_held": b.eager_when_held, "eager_held_calls": b.eager_held_calls,
        "replays": replays, "rows": rows, "padded_rows": padded,
        "tokens": tokens, "padded_tokens": padded_tokens, "eager_calls": eager_calls,
        "capture_s": b.capture_s, "verify_s": b.verify_s,
        "pool_bytes": b.pool_bytes, "pool_estimate": b.pool_estimate,
    }


def key_stats(ks: Key) -> dict:
    counts = counts_of(ks)
    buckets = {}
    for b in sorted(ks.buckets.values(), key=lambda b: (b.seq or 0, b.size)):
        if b.serves is Serves.NOTHING and not counts[id(b)][0] and not b.graphs:
            continue
        buckets[_name(b)] = bucket_stats(b, counts[id(b)])
    return {
        "key": ks.label,
        "status": "eager" if ks.failed else "graphed",
        "reason": ks.failed,
        "lengths": None if not ks.has_seq else ("exact: " + ks.exact if ks.exact else "padded"),
        "eager_calls": ks.eager_calls,
        "large_batches": {f"{k} chunks": how for k, how in sorted(ks.large.items())},
        "large_eager_calls": ks.large_eager,
        "large_eager_rows": ks.large_rows,
        "eager_while_warming": ks.warming_calls,
        "buckets": buckets,
        "pool_bytes": sum(b["pool_bytes"] for b in buckets.values()),
        "static_input_bytes": sum(g.nbytes() for b in ks.buckets.values() for g in b.graphs),
    }


def engine_stats(engine) -> dict:
    keys = [key_stats(ks) for ks in engine.store.keys.values()]
    every = [b for k in keys for b in k["buckets"].values()]
    rows = sum(b["rows"] for b in every) + sum(k["large_eager_rows"] for k in keys)
    padded = sum(b["padded_rows"] for b in every)
    tokens = sum(b["tokens"] for b in every)
    padded_tokens = sum(b["padded_tokens"] for b in every)
    by_choice = sum(b["eager_calls"] for b in every if b["state"] == "eager")
    by_choice += sum(k["large_eager_calls"] for k in keys)
    return {
        "keys": keys,
        "buckets": None if engine.adaptive is not None else list(engine.grid.batch.buckets),
        "seq_buckets": list(engine.grid.seq_buckets()) if engine.decl.has_seq else None,
        "bucket_policy": repr(engine.policy) if engine.policy is not None else None,
        "compile": _compile_stats(engine, every),
        "eager_calls": dict(engine.eager_counts),
        "module_changes": dict(engine.changes),
        "generate": dict(engine.generates),
        "writes_buffers": list(engine.capturer.writes or ()),
        "eager_by_choice": by_choice,
        "graph_pool_bytes": sum(k["pool_bytes"] for k in keys),
        "static_input_bytes": sum(k["static_input_bytes"] for k in keys),
        "rows": rows,
        "padded_rows": padded,
        "padded_share": padded / (rows + padded) if rows + padded else 0.0,
        "tokens": tokens,
        "padded_tokens": padded_tokens,
        "padded_token_share": padded_tokens / (tokens + padded_tokens) if tokens + padded_tokens else 0.0,
        "device": str(engine.store.device) if engine.store.device is not None else None,
    }


def _compile_stats(engine, every) -> Optional[dict]:
    if engine.compile_opts is None:
        return None
    cf = engine.capturer.compiled
    return {
        "options": dict(engine.compile_opts),
        "off": engine.capturer.compile_off,
        "graphs": cf.graphs if cf is not None else 0,
        "compile_s": sum(b["compile_s"] for b in every),
        "buckets_compiled": sum(bool(b["compiled"]) for b in every),
        "background": engine.capturer.background_state,
        "background_error": engine.capturer.background_error,
        "per_size_graphs": engine.capturer.static_forward.graphs if engine.capturer.static_forward is not None else 0,
        "buckets_per_size": sum(b["kernels"] == "per-size" for b in every),
        "tuning": "running" if engine.capturer.worker.busy() else "idle",
        "tuning_error": engine.capturer.tuning_error,
    }


def cost(engine, ks: Key, rows: int, L: Optional[int]) -> float:
    """What a call of ``rows`` rows at length ``L`` costs, in µs: its bucket's measured time, or
    an estimate from the key's buckets already timed (tokens at the rate of the slowest of them
    per token, plus the time of the fastest call); 1 µs a token plus 50 µs where none is."""
    S = engine.grid.seq_for(L, exact=ks.exact is not None) if ks.has_seq and L is not None else None
    size = engine.grid.size(rows, S)
    b = ks.buckets.get((size, S))
    if b is not None and b.graph_us is not None:
        return b.graph_us if b.serves is Serves.GRAPH else (b.eager_us or b.graph_us)
    timed = [(x.graph_us, x.size * (x.seq or 1)) for x in ks.buckets.values() if x.graph_us is not None]
    tokens = size * (S or 1)
    if not timed:
        return 50.0 + tokens
    per_token = max(us / n for us, n in timed)
    return min(us for us, _ in timed) + per_token * tokens
