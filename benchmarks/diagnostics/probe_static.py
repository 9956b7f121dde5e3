"""Probe behind the tuner: shared dynamic-batch kernels against per-size static kernels and
torch.compile, with and without Inductor's layout optimization (results-*/probe-static.log)."""
import statistics
import sys
import time

import torch
import torchvision
import transformers as tr

from graphwrap import GraphedModule

dev = "cuda"
def per_call(fn, args, kwargs, n=30, rounds=7):
    for _ in range(3):
        fn(*args, **kwargs)
    torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(*args, **kwargs)
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(ts), min(ts), max(ts)

def hand(fn, args, kwargs):
    sa = [a.clone() for a in args]; sk = {k: v.clone() for k, v in kwargs.items()}
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn(*sa, **sk)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*sa, **sk)
    def call(*a, **k):
        for d, x in zip(sa, a): d.copy_(x)
        for kk, v in k.items(): sk[kk].copy_(v)
        g.replay()
    return call

def resnet(bs):
    m = torchvision.models.resnet50().to(dev).half().eval()
    return m, (torch.randn(bs, 3, 224, 224, device=dev, dtype=torch.half),), {}
def gpt2(bs):
    m = tr.GPT2LMHeadModel(tr.GPT2Config(use_cache=False)).to(dev).half().eval()
    return m, (), {"input_ids": torch.randint(0, 50000, (bs, 64), device=dev)}
def bert(bs):
    m = tr.BertModel(tr.BertConfig()).to(dev).half().eval()
    ids = torch.randint(0, 30000, (bs, 128), device=dev)
    return m, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

print(torch.cuda.get_device_name(), torch.__version__, time.strftime("%Y-%m-%d %H:%M"), flush=True)
cases = [(resnet, 1), (resnet, 16), (gpt2, 16), (gpt2, 1), (bert, 16)]
only = sys.argv[1:] 
for build, bs in cases:
    torch.manual_seed(0)
    model, args, kwargs = build(bs)
    name = f"{build.__name__}@{bs}"
    with torch.no_grad():
        rows = {}
        torch._dynamo.reset()
        t0 = time.perf_counter(); f = torch.compile(model, mode="reduce-overhead"); rows["torch.compile RO"] = per_call(f, args, kwargs); c0 = time.perf_counter() - t0
        torch._dynamo.reset()
        with torch._inductor.config.patch(layout_optimization=False):
            f = torch.compile(model, mode="reduce-overhead"); rows["torch.compile RO, layout_opt off"] = per_call(f, args, kwargs)
        torch._dynamo.reset()
        f = torch.compile(model, options={"triton.cudagraphs": False}); f(*args, **kwargs)
        rows["torch.compile no cg + hand graph"] = per_call(hand(f, args, kwargs), args, kwargs)
        torch._dynamo.reset()
        t0 = time.perf_counter(); g = GraphedModule(model, compile=True, outputs="view"); g(*args, **kwargs); c1 = time.perf_counter() - t0
        rows["gm compile=True view"] = per_call(g, args, kwargs)
        print(name, "gm dyn stats", {k: v for k, v in g.stats()["compile"].items()}, flush=True)
        del g
        t0 = time.perf_counter(); g = GraphedModule(model, compile={"dynamic": False}, outputs="view"); g(*args, **kwargs); c2 = time.perf_counter() - t0
        rows["gm compile dynamic=False view"] = per_call(g, args, kwargs)
        del g
        if bs > 1:
            torch._dynamo.reset()
            f = torch.compile(model, options={"triton.cudagraphs": False})
            x = [a.clone() for a in args]; k = {kk: v.clone() for kk, v in kwargs.items()}
            for a in list(x) + list(k.values()):
                torch._dynamo.mark_dynamic(a, 0)
            f(*x, **k)
            rows["torch.compile no cg, batch marked dynamic + hand graph"] = per_call(hand(f, x, k), args, kwargs)
        for r, (med, lo, hi) in rows.items():
            print(f"{name:12s} {r:55s} {med:8.3f} ms  [{lo:.3f}, {hi:.3f}]", flush=True)
        print(name, f"first call s: torch.compile {c0:.1f}, gm dyn {c1:.1f}, gm static {c2:.1f}", flush=True)
    del model
    torch._dynamo.reset(); torch.cuda.empty_cache()
