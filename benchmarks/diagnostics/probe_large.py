"""Diagnostic: where a batch above the largest bucket spends its time (seed MLP, batch 300)."""
import logging
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from workloads import SeedMLP  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402

logging.basicConfig(level=logging.INFO)
dev = "cuda"
model = SeedMLP().to(dev).eval()
xs = [torch.randn(300, 1024).pin_memory() for _ in range(50)]
xd = [x.to(dev) for x in xs]
gm = GraphedModule(model)


def timed(name, fn, reps=3):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) / len(xs) * 1e6)
    print(f"{name:60s} {min(ts):8.1f} us/batch", flush=True)


with torch.no_grad():
    gm(xs[0])
    timed("eager loop m(x.to(cuda))", lambda: [model(x.to(dev)) for x in xs])
    timed("eager forward, device input", lambda: [model(x) for x in xd])
    timed("gm(x), pinned host input", lambda: [gm(x) for x in xs])
    timed("gm(x), device input", lambda: [gm(x) for x in xd])
    print(gm.stats()["keys"][0]["large_batches"], [k["key"] for k in gm.stats()["keys"]])
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for x in xs[:20]:
            gm(x)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50))
