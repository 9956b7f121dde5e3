"""Scenario "routing": ``Replicas.generate`` over every GPU, calls routed by prefix against the least
loaded, side by side in one process.

The shared-prompt workload of ``prefix.py`` (``--groups`` groups of ``--per-group`` prompts, each
group with its own system prompt of ``--prefix-len`` tokens and a question of ``--question-len``,
``--new`` new tokens each), the prompts in a shuffled order (the groups' calls mixed as a
server's are), all submitted at once through ``Replicas.submit_generate``. One ``Replicas``
(prefix caching on, the default) serves every run: a first run (captures included, reported
apart), then ``--repeats`` rounds of one run with ``routing="load"`` and one with ``"prefix"``.
Each run draws prompts of its own, so no run finds an earlier run's prefixes.

Reported per setting: output tokens/s and time to first token p50 (medians with their spread),
the prompt tokens found cached (the hit rate), the calls each replica took and how many a match
routed.

``python3 benchmarks/routing.py [--model llama3-8b]`` on two or more GPUs; ``--model tiny`` on a
CPU runs one replica (a smoke run: its times say nothing).
"""

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prefix import First, model_of, shared  # noqa: E402

from graphwrap import Replicas  # noqa: E402


def burst(reps, prompts, new):
    """Every prompt at once: (seconds, time to first token of each)."""
    clocks = [First() for _ in prompts]
    for d in reps.devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)
    t0 = time.perf_counter()
    futs = [reps.submit_generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, streamer=c)
            for p, c in zip(prompts, clocks)]
    for f in futs:
        f.result()
    dt = time.perf_counter() - t0
    return dt, [c.at - t0 for c in clocks if c.at is not None]


def _counts(reps):
    """Per replica: (prompt tokens queried, found cached, generate calls taken)."""
    out = []
    for gm in reps.modules:
        c = (gm.stats().get("decode") or {}).get("prefix_cache") or {}
        out.append((c.get("prefix_cache_queries", 0), c.get("prefix_cache_hits", 0)))
    return out


def one_run(reps, a, vocab, seed: int, routing: str) -> dict:
    reps.routing = routing
    prompts = shared(a, vocab, seed)
    random.Random(seed).shuffle(prompts)
    before, routed = _counts(reps), dict(reps.routed)
    seconds, ttft = burst(reps, prompts, a.new)
    after = _counts(reps)
    queries = [x[0] - y[0] for x, y in zip(after, before)]
    hits = [x[1] - y[1] for x, y in zip(after, before)]
    by = {k: v - routed.get(k, 0) for k, v in reps.routed.items()}
    r = {"routing": routing, "seconds": seconds, "tokens_s": a.new * len(prompts) / seconds,
         "ttft_p50_ms": 1e3 * statistics.median(ttft), "hit_rate": sum(hits) / max(1, sum(queries)),
         "queries_per_replica": queries, "hits_per_replica": hits, "routed": by}
    print(f"  {routing:6s}: {r['tokens_s']:,.0f} tokens/s, time to first token p50 {r['ttft_p50_ms']:,.0f} ms, "
          f"hit rate {r['hit_rate']:.1%}, prompt tokens per replica {queries}, routed {by}", flush=True)
    return r


def _summary(runs, routing):
    mine = [r for r in runs if r["routing"] == routing]
    tps = [r["tokens_s"] for r in mine]
    return {"tokens_s": statistics.median(tps), "tokens_s_spread": [min(tps), max(tps)],
            "ttft_p50_ms": statistics.median(r["ttft_p50_ms"] for r in mine),
            "hit_rate": statistics.median(r["hit_rate"] for r in mine)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--devices", default=None, help="comma-separated (default: every CUDA device)")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.devices:
        devices = [torch.device(d) for d in a.devices.split(",")]
    elif torch.cuda.is_available():
        devices = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    else:
        devices = [torch.device("cpu")]
    head = {"devices": [torch.cuda.get_device_name(d) if d.type == "cuda" else "cpu" for d in devices],
            "torch": torch.__version__, "date": str(datetime.date.today()), "args": vars(a)}
    print(head, flush=True)
    t0 = time.perf_counter()
    reps = Replicas(lambda d: model_of(a.model, d), devices=devices)
    vocab = reps.modules[0].module.config.vocab_size
    print(f"{len(devices)} replicas made in {time.perf_counter() - t0:.1f} s", flush=True)
    print("first run (captures included):", flush=True)
    first = one_run(reps, a, vocab, 0, "prefix")
    for d, gm in zip(devices, reps.modules):
        off = (gm.stats().get("decode") or {}).get("off")
        if off is not None:
            raise SystemExit(f"{d}: the shared batch does not serve ({off}): nothing here would say what routing does")
    runs = []
    for i in range(a.repeats):
        for routing in ("load", "prefix"):
            runs.append(one_run(reps, a, vocab, 1 + 2 * i + (routing == "prefix"), routing))
    reps.close()
    load, prefix = _summary(runs, "load"), _summary(runs, "prefix")
    print(f"prefix routing against the least loaded: {prefix['tokens_s'] / load['tokens_s']:.2f}x tokens/s "
          f"({prefix['tokens_s']:,.0f} against {load['tokens_s']:,.0f}), time to first token "
          f"{load['ttft_p50_ms'] / prefix['ttft_p50_ms']:.2f}x lower, hit rate {prefix['hit_rate']:.1%} against "
          f"{load['hit_rate']:.1%}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**head, "first_run": first, "runs": runs, "load": load, "prefix": prefix}, f, indent=1,
                      default=str)


if __name__ == "__main__":
    main()
