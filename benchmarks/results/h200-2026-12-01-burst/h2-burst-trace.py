"""Scratch: where a warm FP8 256-burst's 1.5 s go. Per warm burst: the decode thread's parts and
counts; then one warm burst under the profiler (CPU and CUDA), exported as a Chrome trace."""
import gzip
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from prefix import model_of

import graphwrap
from graphwrap import GraphedModule

dev = torch.device("cuda")
kind = sys.argv[1] if len(sys.argv) > 1 else "fp8"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 256
model = model_of("llama3-8b", dev)
if kind != "fp16":
    graphwrap.quantize(model, kind)
gm = GraphedModule(model)
vocab = model.config.vocab_size
g = torch.Generator().manual_seed(0)
def batch():
    return [torch.randint(3, vocab, (1, 128), generator=g).to(dev) for _ in range(n)]
def calls(ps):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    fs = [gm.submit_generate(p, max_new_tokens=128, do_sample=False) for p in ps]
    for f in fs: f.result()
    return time.perf_counter() - t0
print("first", calls(batch()), flush=True)
server = gm.__dict__["_gw_decode"]
server.captures.finish(600)
for r in range(4):
    s0, c0 = dict(server.spent), dict(server.counts)
    t = calls(batch())
    ds = {k: round(v - s0.get(k, 0), 3) for k, v in server.spent.items()}
    dc = {k: v - c0.get(k, 0) for k, v in server.counts.items() if v != c0.get(k, 0)}
    print(f"warm {r}: {t:.3f} s, {n*128/t:,.0f} tok/s; thread {ds}; counts {dc}", flush=True)
d = gm.stats()["decode"]
print("turn_ms", d.get("turn_ms"), "slowest", str(d.get("slowest_turns"))[:800], flush=True)
from torch.profiler import ProfilerActivity, profile

ps = batch()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t = calls(ps)
print(f"profiled burst {t:.3f} s", flush=True)
out = os.environ.get("OUT", "/tmp")
prof.export_chrome_trace("/tmp/trace.json")
with open("/tmp/trace.json", "rb") as f, gzip.open(os.path.join(out, f"trace-{kind}-{n}.json.gz"), "wb") as o:
    shutil.copyfileobj(f, o)
gm.close()
