"""``GET /metrics``: the server's counts in Prometheus' text format (version 0.0.4), written
here (no client library): counters and histograms the requests feed, and gauges read from the
shared batch's ``stats()`` when scraped."""

import bisect
import threading
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
           80.0)
PREFIX = "graphwrap_"
LAG_EVERY = 0.05  # seconds between the event loop's lag samples


def _num(v: float) -> str:
    """A sample's value, whole numbers in full (``%g`` would round bytes to six digits)."""
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _labels(labels: Tuple[Tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"


class Counter:
    def __init__(self, name: str, help: str):
        self.name, self.help = PREFIX + name, help
        self.values: Dict[Tuple[Tuple[str, str], ...], float] = {}
        self.lock = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str):
        key = tuple(sorted(labels.items()))
        with self.lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def lines(self) -> List[str]:
        with self.lock:
            items = sorted(self.values.items())
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        return out + [f"{self.name}{_labels(k)} {_num(v)}" for k, v in (items or [((), 0.0)])]


class Histogram:
    def __init__(self, name: str, help: str, buckets: Sequence[float] = LATENCY):
        self.name, self.help, self.buckets = PREFIX + name, help, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.lock = threading.Lock()

    def observe(self, seconds: float):
        i = bisect.bisect_left(self.buckets, seconds)
        with self.lock:
            self.counts[i] += 1
            self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def lines(self) -> List[str]:
        with self.lock:
            counts, total = list(self.counts), self.sum
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for le, c in zip(list(self.buckets) + [float("inf")], counts):
            running += c
            out.append(f'{self.name}_bucket{{le="{"+Inf" if le == float("inf") else f"{le:g}"}"}} {running}')
        return out + [f"{self.name}_sum {_num(total)}", f"{self.name}_count {running}"]


def gauge(name: str, help: str, value: Optional[float]) -> List[str]:
    if value is None:
        return []
    return [f"# HELP {PREFIX}{name} {help}", f"# TYPE {PREFIX}{name} gauge", f"{PREFIX}{name} {_num(value)}"]


class Metrics:
    """What the server counts itself; :meth:`render` adds the batch's gauges."""

    def __init__(self):
        self.requests = Counter("requests_total", "HTTP requests answered, by endpoint and status.")
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens of the requests served.")
        self.generation_tokens = Counter("generation_tokens_total", "Tokens generated for the requests.")
        self.ttft = Histogram("time_to_first_token_seconds", "From a request's arrival to its first token.")
        self.tpot = Histogram("time_per_output_token_seconds", "Between the tokens of a sequence, on average.")
        self.e2e = Histogram("request_latency_seconds", "From a request's arrival to its last token.")
        self.loop_lag = Histogram("event_loop_lag_seconds", "How late the HTTP event loop ran a timer due every "
                                  f"{LAG_EVERY * 1e3:g} ms (a loop that falls behind delays every stream).")

    def render(self, stats: dict, running: int) -> str:
        out: List[str] = []
        for m in (self.requests, self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e):
            out += m.lines()
        out += self.loop_lag.lines()
        out += gauge("requests_running", "HTTP requests being answered (streams until their end).", running)
        engines = stats.get("engines")
        if engines is None:
            out += families(batch_samples(stats, ()))
        else:  # (--data-parallel: each engine's figures labelled with its index)
            out += families([x for i, e in enumerate(engines) for x in batch_samples(e, (("engine", str(i)),))])
        out += families(routed_samples(stats.get("routed") or {}))  # (several engines: how they were given work)
        return "\n".join(out) + "\n"


Sample = Tuple[str, str, str, Tuple[Tuple[str, str], ...], Optional[float]]  # name, help, type, labels, value


def families(samples: Iterable[Sample]) -> List[str]:
    """Samples as metric families: each name's HELP and TYPE once, then its samples (those with
    no value left out), in the order the names first came."""
    by: Dict[str, List[Sample]] = {}
    for x in samples:
        if x[4] is not None:
            by.setdefault(x[0], []).append(x)
    out: List[str] = []
    for name, xs in by.items():
        out += [f"# HELP {PREFIX}{name} {xs[0][1]}", f"# TYPE {PREFIX}{name} {xs[0][2]}"]
        out += [f"{PREFIX}{name}{_labels(labels)} {_num(v)}" for _, _, _, labels, v in xs if v is not None]
    return out


def batch_samples(stats: dict, labels: Tuple[Tuple[str, str], ...]) -> List[Sample]:
    """What one engine's ``stats()`` says, as samples labelled ``labels``."""
    out: List[Sample] = [(n, h, "gauge", labels, v) for n, h, v in batch_gauges(stats)]
    out += [(n, h, "counter", labels, v) for n, h, v in prefix_totals(stats)]
    servers = stats.get("api_servers")
    if servers:  # (--api-servers: every HTTP process's share, whichever answers the scrape)
        out += [("engine_requests_total", "Requests the engine process took, by the HTTP process that sent them (0: "
                 "the server's own, then the others in the order they connected).", "counter",
                 labels + (("api_server", str(i)),), n) for i, n in enumerate(servers)]
    pauses = stats.get("engine_gc")
    if pauses:
        out.append(("engine_gc_pause_max_seconds", "The longest pause of the engine process's garbage collector.",
                    "gauge", labels, max(g["max_ms"] for g in pauses.values()) / 1e3))
    out.append(("gpu_memory_allocated_bytes", "Bytes torch's allocator has handed out on the GPU.", "gauge", labels,
                stats.get("gpu_memory_allocated")))
    return out


def routed_samples(routed: dict) -> List[Sample]:
    """How ``--data-parallel``'s sequences were routed."""
    out: List[Sample] = [("engine_sequences_total", "Sequences sent to each engine process.", "counter",
                          (("engine", str(i)),), n) for i, n in enumerate(routed.get("sent") or [])]
    out += [("engine_sequences_running", "Sequences in flight on each engine process.", "gauge",
             (("engine", str(i)),), n) for i, n in enumerate(routed.get("inflight") or [])]
    out += [("routed_sequences_total", "Sequences routed by a prefix match (prefix) or to the least loaded engine "
             "(load).", "counter", (("by", by),), n) for by, n in sorted((routed.get("by") or {}).items())]
    return out


def prefix_totals(stats: dict) -> Iterable[Tuple[str, str, Optional[float]]]:
    """The prefix cache's counts (named as vLLM names them), where the batch caches prefixes."""
    d = stats.get("decode")
    c = d.get("prefix_cache") if isinstance(d, dict) else None
    if not isinstance(c, dict):
        return []
    return [
        ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", c.get("prefix_cache_queries")),
        ("prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed again).",
         c.get("prefix_cache_hits")),
    ]


def batch_gauges(stats: dict) -> Iterable[Tuple[str, str, Optional[float]]]:
    """What the shared batch says of itself (nothing before it is made)."""
    d = stats.get("decode")
    if not isinstance(d, dict):
        return []
    blocks = d.get("cache_blocks") or {}
    waits = d.get("queue_wait_ms") or {}
    step = d.get("step") or {}
    return [
        ("sequences_running", "Sequences holding a row of the shared batch.", d.get("rows_busy")),
        ("sequences_queued", "Sequences waiting for a row.", d.get("queued")),
        ("rows", "Rows of the shared batch.", d.get("rows")),
        ("cache_blocks_used", "Blocks of the paged KV cache in use.", blocks.get("used")),
        ("cache_blocks_free", "Blocks of the paged KV cache free.", blocks.get("free")),
        ("cache_bytes", "Bytes of the KV cache.", d.get("cache_bytes")),
        ("prefix_cache_blocks", "Blocks of the paged KV cache known by their content (held or kept for reuse).",
         (d.get("prefix_cache") or {}).get("blocks")),
        ("decode_steps", "Decode steps run (one for every live row at once).", d.get("steps")),
        ("step_replays", "Decode steps served by a CUDA graph's replay.", _sum(step, "replays")),
        ("step_eager_calls", "Decode steps run eagerly.", _eager(step)),
        ("graph_bytes", "Bytes the batch's graphs hold (their pools and static inputs).",
         sum(float(e.get("graph_pool_bytes", 0) + e.get("static_input_bytes", 0)) for e in (step, d.get("prefill") or {}))),
        ("graph_captures", "Graphs the batch captured beside its decode thread since it was made.",
         (d.get("captures") or {}).get("done")),
        ("eager_forwards", "Forwards run eagerly while their shape's graph was being captured.",
         sum((d.get("eager_forwards") or {}).values()) if "eager_forwards" in d else None),
        ("decode_turn_p99_seconds", "99th percentile of the decode thread's turns (a step and its tokens), over the "
         "last 10,000.", _seconds((d.get("turn_ms") or {}).get("p99"))),
        ("decode_turn_max_seconds", "The decode thread's longest turn of the last 10,000.",
         _seconds((d.get("turn_ms") or {}).get("max"))),
        ("token_delivery_p99_seconds", "99th percentile of a token's wait from its step to its stream's feed, over the "
         "last 10,000 (the batch's delivery threads falling behind shows here, not in the turns).",
         _seconds((d.get("delivery_lag_ms") or {}).get("p99"))),
        ("queue_wait_p50_seconds", "Median wait for a row, over the last 10,000 sequences.",
         None if waits.get("p50") is None else waits["p50"] / 1e3),
        ("queue_wait_p99_seconds", "99th percentile of the wait for a row, over the last 10,000 sequences.",
         None if waits.get("p99") is None else waits["p99"] / 1e3),
    ]


def _seconds(ms: Optional[float]) -> Optional[float]:
    return None if ms is None else ms / 1e3


def _sum(engine: dict, name: str) -> float:
    return float(sum(b.get(name, 0) for k in engine.get("keys", []) for b in k.get("buckets", {}).values()))


def _eager(engine: dict) -> float:
    """Eager calls for a reason (no CUDA, say) and by choice (eager measured faster)."""
    return float(sum((engine.get("eager_calls") or {}).values()) + engine.get("eager_by_choice", 0))
