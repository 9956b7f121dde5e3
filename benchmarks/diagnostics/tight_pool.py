"""The shared batch with a pool too small for every request's whole length at once.

``python benchmarks/diagnostics/tight_pool.py [--model llama2-7b] [--cache-memory 0.16]``

The generate-large workload (64 requests at once, prompts 16..1,024, new tokens 32..512, greedy,
fp16, random weights) through ``GraphedModule(model, decode={"cache_memory": X})``, so that the
pool holds fewer positions than the requests' prompts and ``max_new_tokens`` add up to. Run it
with one graphwrap, then another (``PYTHONPATH=DIR``, the earlier package's folder first), on
the same machine: the first burst and a warm one, tokens/s, time to first token, queue waits,
rows per step, preemptions, and 4 requests' first 48 tokens against ``model.generate`` alone.
"""

import argparse
import os
import sys

import torch

sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from generate import burst, check_tokens, fresh_latencies  # noqa: E402
from generate_large import big_model, workload  # noqa: E402

import graphwrap  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--cache-memory", type=float, default=0.16)
    a = ap.parse_args()
    dev = torch.device("cuda")
    print(f"graphwrap from {os.path.dirname(graphwrap.__file__)}; {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}", flush=True)
    model = big_model(a.model, dev)
    reqs = workload(model.config.vocab_size)
    tokens = sum(k for _, k in reqs)
    whole = sum(p.shape[1] + k for p, k in reqs)
    gm = graphwrap.GraphedModule(model, decode={"cache_memory": a.cache_memory})
    for name in ("first burst", "warm burst"):
        fresh_latencies(gm)
        t, *_ = burst(gm, reqs, dev)
        d = gm.stats()["decode"]
        print(f"{name}: {tokens / t:,.0f} tokens/s ({t:.2f} s); time to first token p50 {d['ttft_ms']['p50']:.0f} / "
              f"p99 {d['ttft_ms']['p99']:.0f} ms; per output token p50 {d['tpot_ms']['p50']:.2f} / p99 "
              f"{d['tpot_ms']['p99']:.2f} ms", flush=True)
    blocks = d["cache_blocks"]
    print(f"pool: {blocks['used'] + blocks['free']} blocks of {blocks['block']} "
          f"({(blocks['used'] + blocks['free']) * blocks['block']:,} positions) for requests whose prompts and "
          f"max_new_tokens add up to {whole:,}; {d['steps']} steps of {d['rows_per_step']:.1f} rows, queue wait p50 "
          f"{d['queue_wait_ms']['p50']:.0f} / p99 {d['queue_wait_ms']['p99']:.0f} ms, preempted "
          f"{d.get('preempted', 'n/a')}, thread {d['thread_s']}", flush=True)
    equal, gaps = check_tokens(model, gm, [(p, min(k, 48)) for p, k in reqs[:4]], dev, k=4)
    print(f"tokens against model.generate alone: {equal} of 4 equal" + (f" (gaps {gaps})" if gaps else ""))
    gm.close()


if __name__ == "__main__":
    main()
