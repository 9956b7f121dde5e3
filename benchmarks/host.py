"""Scenario "host": where the host time of one batch-1 pipeline step goes.

Each operation of a step is issued N times in a row and the host time to issue them is
divided by N (the device is synchronized before and after, outside the timed region). The
GPU runs each op in a few microseconds, so these are the costs of issuing, not of running.
"""

import time

import torch

from graphwrap import GraphedModule
from workloads import SeedMLP


def _issue_time(fn, n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / n


def run(results, device, quick: bool, repeats: int):
    n = 200 if quick else 1000
    model = SeedMLP().to(device).eval()
    gm = GraphedModule(model)
    x = torch.randn(1, 1024).pin_memory()
    xs = [x] * n
    with torch.no_grad():
        gm(x.to(device))
        for _ in gm.pipeline(xs[:8]):
            pass
    rep = gm._gw_store.keys[next(iter(gm._gw_store.keys))].buckets[1].replicas[0]
    static_in, static_out = rep.static_inputs[0], rep.static_outputs[0]
    compute, copy = torch.cuda.current_stream(), torch.cuda.Stream()
    ev = torch.cuda.Event()
    host_out = torch.empty(static_out.shape, pin_memory=True)
    ops = {
        "gm._prepare (flatten, key, checks)": lambda: gm._prepare((x,), {}),
        "Tensor.is_pinned()": lambda: x.is_pinned(),
        "set_stream there and back": lambda: (torch.cuda.set_stream(copy), torch.cuda.set_stream(compute)),
        "H2D copy_ from pinned, non_blocking": lambda: static_in.copy_(x, non_blocking=True),
        "Event.record": lambda: ev.record(compute),
        "Stream.wait_event": lambda: compute.wait_event(ev),
        "CUDAGraph.replay()": lambda: rep.graph.replay(),
        "clone of the output": lambda: static_out.clone(),
        "torch.empty(pin_memory=True) of the output's size": lambda: torch.empty(static_out.shape, pin_memory=True),
        "D2H copy_ into pinned, non_blocking": lambda: host_out.copy_(static_out, non_blocking=True),
        "Stream.wait_stream": lambda: copy.wait_stream(compute),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
    }
    def stream_ctx():
        with torch.cuda.stream(copy):
            pass

    ops["with torch.cuda.stream(s): pass"] = stream_ctx
    with torch.no_grad():
        for name, fn in ops.items():
            ts = [_issue_time(fn, n) for _ in range(repeats)]
            results.add("host", "one batch-1 step, per op", name, ts, "us", None, None)
        ts = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in gm.pipeline(xs):
                pass
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) / n)
        results.add("host", "one batch-1 step, per op", "whole pipeline step (wall, incl. GPU)", ts, "us", None, None)
        ts = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in gm.pipeline(xs, to_host=True):
                pass
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) / n)
        results.add("host", "one batch-1 step, per op", "whole pipeline step, to_host (wall, incl. GPU)", ts, "us",
                    None, None)
