"""The shared batch's first seconds: a first burst against warm ones, and a closed loop from cold.

The bench ``generate`` workload (64 requests, prompts 16..128, 32..256 new tokens, greedy, fp16,
random weights) on GPT-2, the 1.1B Llama shape or the Llama-3-8B shape (``--times K``: K such
sets of prompts at once), in this process:

1. a GraphedModule made here: its first burst (the batch made, every shape new), then
   ``--warm`` warm bursts (3; more, such as 12, with every burst's time, to set two trees side
   by side, a process each, where three cannot tell them apart), then a burst with a streamer on each request (time to first token and per
   output token, from the streamers);
2. a second GraphedModule of the same model (the process warm: cuBLAS, attention kernels and
   Triton set up; its batch and shapes new): its first burst;
3. a third: a closed loop of 64 client threads for ``--seconds``, then another once warm.
   Latencies from the batch's own ``stats()``.

Each part prints what the batch says of its shapes (captured, run eagerly, in a larger graph).
Run from the project root, or from an older tree's root for a before/after:
``python3 benchmarks/diagnostics/first_burst.py gpt2 [--seconds 5] [--warm 3] [--only-warm] [--compile [--compiled]]
[--ahead first|every]`` (``--compile``: part 1's bursts alone, with ``compile=True``; ``--compiled``: the warm
bursts after every queued compile; ``--only-warm``: part 1's bursts alone; ``--ahead``: part 1's
GraphedModule first captures ahead, ``gm.capture_generate(shapes=...)``, timed apart, as ``serve``
does before it answers)
"""

import argparse
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ".")
import generate as g  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402


def shapes(gm) -> str:
    d = gm.stats()["decode"]
    caps = d.get("captures") or {}
    return (f"shapes {len(d['shapes'])}, eager forwards {d.get('eager_forwards', '-')}, in a larger graph "
            f"{d['in_a_larger_graph']}, captures beside the decode thread {caps.get('done', '-')} in "
            f"{caps.get('seconds', '-')} s (queued {len(caps.get('queued', []))}), failed {d.get('capture_failed', '-')}"
            + (f", compiled {caps['compiled']}" if caps.get("compiled") is not None and "compiled_engines" in d else ""))


def compile_costs(name: str):
    """Where ``compile=True``'s time went in this process (torch's own counts): Inductor's FX
    graph cache and AOTAutograd's cache, hits against misses (a second process on the machine
    hits what the first one wrote), and the seconds of each phase dynamo times."""
    from torch._dynamo.utils import compile_times, counters

    caches = {k: v for k, v in counters["inductor"].items() if "cache" in k}
    caches.update({f"aot_autograd {k}": v for k, v in counters["aot_autograd"].items() if "cache" in k or "autograd" in k})
    print(f"[{name}] torch's caches: {dict(sorted(caches.items()))}", flush=True)
    try:
        table = compile_times(repr="csv", aggregate=True)
        phases = sorted(zip(table[0], table[1]), key=lambda kv: -float(kv[1]))[:10]
        print(f"[{name}] compile phases, seconds in all: " + ", ".join(f"{k} {float(v):.1f}" for k, v in phases),
              flush=True)
    except Exception as e:  # noqa: BLE001 - torch's reporting changes between versions
        print(f"[{name}] compile phases not read: {type(e).__name__}: {e}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=["gpt2", "llama", "llama3-8b"])
    ap.add_argument("--times", type=int, default=1, help="the workload's 64 requests this many times over, each "
                    "set with prompts of its own, at once")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--log", action="store_true", help="graphwrap's log on stderr, ms since the process began")
    ap.add_argument("--compile", action="store_true", help="GraphedModule(model, compile=True): the first burst "
                    "and three more, nothing else")
    ap.add_argument("--compiled", action="store_true", help="with --compile: wait for the queued compiles "
                    "after the first burst, so that the warm bursts run the compiled graphs")
    ap.add_argument("--no-cudnn", action="store_true", help="torch's cuDNN attention turned off for the run")
    ap.add_argument("--warm", type=int, default=3, help="warm bursts after the first (their median, and each)")
    ap.add_argument("--only-warm", action="store_true", help="the first burst and the warm ones, nothing else")
    ap.add_argument("--ahead", choices=["first", "every"], default=None,
                    help="gm.capture_generate(shapes=...) before the first burst, timed apart")
    a = ap.parse_args()
    if a.no_cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if a.log:
        logging.basicConfig(format="%(relativeCreated)7.0f ms %(threadName)s: %(message)s")
        logging.getLogger("graphwrap").setLevel(logging.INFO)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"graphwrap from {os.path.dirname(sys.modules['graphwrap'].__file__)}", flush=True)
    if a.model == "llama3-8b":
        from generate_large import big_model

        model = big_model(a.model, dev)
    else:
        model = g._model(a.model, dev)
    base = g.workload(model.config.vocab_size)
    reqs = base + [r for i in range(1, a.times) for r in g.renewed(base, 100 + i, model.config.vocab_size)]
    tokens = sum(k for _, k in reqs)

    gm = GraphedModule(model, compile=True) if a.compile else GraphedModule(model)
    if a.ahead:
        t0 = time.perf_counter()
        done = gm.capture_generate(shapes=a.ahead)
        print(f"[{a.model}] capture_generate(shapes={a.ahead!r}): {time.perf_counter() - t0:.2f} s (done: {done}); "
              f"{shapes(gm)}", flush=True)
    first, *_ = g.burst(gm, reqs, dev)
    print(f"[{a.model}] first burst: {first:.3f} s ({tokens / first:,.0f} tokens/s); {shapes(gm)}; decode thread "
          f"{gm.stats()['decode']['thread_s']}", flush=True)
    if a.compile and a.compiled:  # (the queued compiles all done before the warm bursts)
        t0 = time.perf_counter()
        done = gm.__dict__["_gw_decode"].captures.finish(600)
        print(f"[{a.model}] compile=True: the queued compiles done in {time.perf_counter() - t0:.1f} s "
              f"({'all' if done else 'not all, in 600 s'}); {shapes(gm)}", flush=True)
    vocab = model.config.vocab_size  # (each warm burst's prompts its own: a prompt sent again is a prefix cache hit)
    warm = [g.burst(gm, g.renewed(reqs, 1 + r, vocab), dev)[0] for r in range(a.warm)]
    w = statistics.median(warm)
    print(f"[{a.model}] {a.warm} warm bursts: median {w:.3f} s (min {min(warm):.3f}, max {max(warm):.3f}; "
          f"{tokens / w:,.0f} tokens/s); first / warm = {first / w:.2f}x; each {[round(t, 3) for t in warm]}", flush=True)
    if a.only_warm:
        gm.close()
        return
    if a.compile:
        print(f"[{a.model}] compile=True, after the bursts: {shapes(gm)}", flush=True)
        compile_costs(a.model)
        gm.close()
        return
    t, _, clocks, _ = g.burst(gm, g.renewed(reqs, 10, vocab), dev, stream=True)
    ttft, tpot = g.latencies(clocks)
    print(f"[{a.model}] burst with a streamer on each request: {t:.3f} s; time to first token p50 "
          f"{1e3 * g.pct(ttft, .5):.1f} / p99 {1e3 * g.pct(ttft, .99):.1f} ms, per output token p50 "
          f"{1e3 * g.pct(tpot, .5):.2f} / p99 {1e3 * g.pct(tpot, .99):.2f} ms", flush=True)
    print(f"[{a.model}] after the bursts: {shapes(gm)}", flush=True)
    gm.close()

    gm = GraphedModule(model)
    again, *_ = g.burst(gm, reqs, dev)
    print(f"[{a.model}] first burst of another GraphedModule, the process warm: {again:.3f} s; first / warm = "
          f"{again / w:.2f}x; {shapes(gm)}", flush=True)
    gm.close()

    gm = GraphedModule(model)
    for name in ("closed loop from cold", "closed loop, warm"):
        g.fresh_latencies(gm)
        rate, _ = g.closed_loop(gm, reqs, dev, a.seconds, vocab)
        lat = g.server_latencies(gm)
        print(f"[{a.model}] {name}, {g.CLIENTS} clients, {a.seconds:.0f} s: {rate:,.0f} tokens/s; time to first token "
              f"p50 {lat['ttft_p50_ms']:.1f} / p99 {lat['ttft_p99_ms']:.1f} ms, per output token p50 "
              f"{lat['tpot_p50_ms']:.2f} / p99 {lat['tpot_p99_ms']:.2f} ms; {shapes(gm)}", flush=True)
    gm.close()


if __name__ == "__main__":
    main()
