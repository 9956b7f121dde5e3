"""Scenario "capture": time to capture every default bucket, with and without verification."""

import time

import torch
from workloads import SeedMLP

from graphwrap import GraphedModule, default_buckets


def _capture_all(results, name, model, sample, verify, max_batch_size):
    torch.cuda.synchronize()
    gm = GraphedModule(model, verify=verify, max_batch_size=max_batch_size)
    t0 = time.perf_counter()
    gm.capture(sample)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    s = gm.stats()
    results.note("capture", name, f"capture all {len(default_buckets(max_batch_size))} buckets, verify={verify}", dt, "s",
                 graph_pool_mib=s["graph_pool_bytes"] / 2**20,
                 verify_s=sum(b["verify_s"] for k in s["keys"] for b in k["buckets"].values()))
    del gm
    torch.cuda.empty_cache()


def run(results, device, quick: bool, repeats: int):
    top = 64 if quick else 256
    mlp = SeedMLP().to(device).eval()
    x = torch.randn(4, 1024, device=device)
    for verify in (True, False):
        _capture_all(results, "seed MLP", mlp, x, verify, top)
    one = GraphedModule(mlp, buckets=[top])
    one.capture(x)
    results.note("capture", "seed MLP", f"graph pool of bucket {top} alone", one.stats()["graph_pool_bytes"] / 2**20, "MiB")
    del one
    try:
        import torchvision
    except ImportError:
        return
    r18 = torchvision.models.resnet18().to(device).eval().half()
    img = torch.randn(4, 3, 224, 224, device=device, dtype=torch.half)
    for verify in (True, False):
        _capture_all(results, "resnet18 fp16 224x224", r18, img, verify, top)
