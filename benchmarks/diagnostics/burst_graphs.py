"""Where a burst of the shared batch goes, graph by graph: ``--burst`` requests of 128 tokens in
and 128 out at once (the Llama-3-8B shape, random weights; ``--quantize fp8`` first), a first
burst apart, then ``--repeats`` warm bursts, each with its tokens/s and the decode thread's
seconds by part and counts; then one more warm burst under the profiler (CPU and CUDA), each
kernel given to the launch it came from: the graphs of prompts' forwards (those with a prompt's
attention kernel), of decode steps (those with the paged step kernel), the rest, and kernels
launched one by one. For each kind: launches, the GPU's time from a launch's first kernel to its
last, the kernels' own time, and the kernels by name per launch; then the GPU's idle time
between launches.

``python3 benchmarks/diagnostics/burst_graphs.py [--quantize fp8] [--burst 256] [--save trace.json.gz]``
from the repository root, on a GPU; ``--trace trace.json.gz``: the same tables from a trace
saved so before (no GPU needed).
"""

import argparse
import collections
import gzip
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PROMPT_ATTENTION = ("fmha", "flash", "attention_kernel", "piece")  # (a prompt's attention kernel's name holds one)


def kind_of(names) -> str:
    """A launch's kind by its kernels' names: a decode step's graph runs the paged step kernel."""
    if any("paged_decode" in n for n in names):
        return "decode step"
    if any(k in n.lower() for n in names for k in PROMPT_ATTENTION):
        return "prompt forward"
    return "other graph"


def launches(trace: dict):
    """``[(start, end, kind, kernels)]`` of a Chrome trace's device work, by the launch it came
    from (a graph's launch, or each kernel or copy launched alone as "one by one"), in order."""
    events = trace["traceEvents"]
    api = {e["args"].get("correlation"): e["name"] for e in events if e.get("cat") == "cuda_runtime"}
    by = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            by[e["args"].get("correlation")].append(e)
    out = []
    for c, ks in by.items():
        start, end = min(e["ts"] for e in ks), max(e["ts"] + e["dur"] for e in ks)
        kind = kind_of([e["name"] for e in ks]) if api.get(c) == "cudaGraphLaunch" else "one by one"
        out.append((start, end, kind, ks))
    return sorted(out, key=lambda x: x[0])


def report(trace: dict, top: int = 10):
    runs = launches(trace)
    if not runs:
        print("no device work in the trace", flush=True)
        return
    wall = runs[-1][1] - runs[0][0]
    print(f"the profiled burst's device work: {wall / 1e3:.1f} ms from the first kernel to the last, "
          f"{len(runs)} launches", flush=True)
    kinds = collections.defaultdict(lambda: [0, 0.0, 0.0, collections.Counter()])
    for start, end, kind, ks in runs:
        k = kinds[kind]
        k[0] += 1
        k[1] += end - start
        k[2] += sum(e["dur"] for e in ks)
        for e in ks:
            k[3][e["name"][:90]] += e["dur"]
    for kind, (n, span, busy, names) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        per = 1 if kind == "one by one" else n
        print(f"  {kind}: {n} launches, {span / 1e3:.1f} ms from first kernel to last ({span / wall:.0%}), "
              f"kernels {busy / 1e3:.1f} ms; {'in all' if per == 1 else f'a launch {span / n / 1e3:.3f} ms'}, "
              f"its kernels:", flush=True)
        for name, t in names.most_common(top if per > 1 else 4):
            print(f"      {t / per / 1e3:8.3f} ms  {name}", flush=True)
    gaps, end, last = collections.Counter(), runs[0][1], runs[0][2]
    for start, e, kind, _ in runs[1:]:  # (launches on other streams overlap: the GPU idles where none runs)
        if start > end:
            gaps[f"{last} -> {kind}"] += start - end
        if e > end:
            end, last = e, kind
    idle = sum(gaps.values())
    print(f"  the GPU idle (no launch's work running): {idle / 1e3:.1f} ms ({idle / wall:.1%}); between:", flush=True)
    for pair, t in gaps.most_common(5):
        print(f"      {t / 1e3:8.1f} ms  {pair}", flush=True)


def bursts(a):
    from prefix import model_of

    import graphwrap
    from graphwrap import GraphedModule

    dev = torch.device("cuda")
    print(f"burst_graphs: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          f"{a.model}, {a.quantize or 'fp16'}, {a.burst} requests of 128 in and 128 out at once", flush=True)
    model = model_of(a.model, dev)
    if a.quantize:
        graphwrap.quantize(model, a.quantize)
    gm = GraphedModule(model)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def burst():
        prompts = [torch.randint(3, vocab, (1, 128), generator=g).to(dev) for _ in range(a.burst)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for f in [gm.submit_generate(p, max_new_tokens=128, do_sample=False) for p in prompts]:
            f.result()
        return time.perf_counter() - t0

    print(f"first burst {burst():.3f} s", flush=True)
    server = gm.__dict__["_gw_decode"]
    server.captures.finish(600)
    for r in range(a.repeats):
        spent, counts = dict(server.spent), dict(server.counts)
        t = burst()
        parts = {k: round(v - spent.get(k, 0), 3) for k, v in server.spent.items()}
        moved = {k: v - counts.get(k, 0) for k, v in server.counts.items() if v != counts.get(k, 0)}
        print(f"warm burst {r}: {t:.3f} s, {a.burst * 128 / t:,.0f} tokens/s; the decode thread's seconds {parts}; "
              f"counts {moved}", flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = burst()
    print(f"a warm burst under the profiler: {t:.3f} s", flush=True)
    gm.close()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        if a.save:
            with open(path, "rb") as f, gzip.open(a.save, "wb") as out:
                shutil.copyfileobj(f, out)
        with open(path) as f:
            return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--quantize", default=None, help="the model through graphwrap.quantize first (fp8, int8, int4)")
    ap.add_argument("--burst", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--save", default=None, help="the profiled burst's Chrome trace, gzipped, to this file")
    ap.add_argument("--trace", default=None, help="only the tables, from a trace saved with --save")
    a = ap.parse_args()
    if a.trace:
        with gzip.open(a.trace) as f:
            trace = json.load(f)
    else:
        trace = bursts(a)
    report(trace)


if __name__ == "__main__":
    main()
