"""Scenario "host": where the host time of one call goes.

Case "gm(x) at batch 1, per piece": each piece of the direct call's common path (one tensor
on the GPU, a shape seen before) issued N times in a row, the host time divided by N, the
device synchronized before and after outside the timed region; then the whole call. Case
"pipeline step at batch 1, per op": the same for the operations of one pipeline step.
"""

import time

import torch
from workloads import SeedMLP

import graphwrap.core.engine as engine_mod
import graphwrap.core.plans as plans_mod
import graphwrap.module as module_mod
from graphwrap import GraphedModule


def _issue_time(fn, n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / n


def _measure(results, case, ops, n, repeats):
    with torch.no_grad():
        for _ in range(2):  # warm every op up
            for fn in ops.values():
                fn()
        for name, fn in ops.items():
            ts = [_issue_time(fn, n) for _ in range(repeats)]
            results.add("host", case, name, ts, "us", None, None)


def _direct_call(results, device, n, repeats):
    model = SeedMLP().to(device).eval()
    x = torch.randn(1, 1024, device=device)
    with torch.no_grad():
        gm = GraphedModule(model, eager_if_faster=False)
        gv = GraphedModule(model, outputs="view", eager_if_faster=False)
        gm(x), gv(x)
    eng = gm.engine
    ring_plan = gm.engine.fast_plan(x)
    assert ring_plan.ring is not None, "no output ring"
    plan = ring_plan
    assert not plan.eager, "the common path is not taken"
    d = gm.__dict__
    hooks = module_mod._GLOBAL_HOOKS
    data_ptr = torch.Tensor.data_ptr
    ptrs = tuple(eng.watch.ptr_list)
    tensors = eng.watch.tensors
    sid = plans_mod.cuda_sid
    idx = x.device.index
    lock = eng.lock

    def locked():
        with lock:
            pass

    ops = {
        "hook check in GraphedModule.__call__": lambda: (d["_forward_pre_hooks"] or d["_forward_hooks"]
                                                         or d["_backward_pre_hooks"] or d["_backward_hooks"]
                                                         or d.get("_compiled_call_impl") is not None
                                                         or any(hooks)),
        "engine.fast_plan(x): lookup and every per-call check": lambda: eng.fast_plan(x),
        "  of which dict lookup by x.shape": lambda: eng.fast.get(x.shape),
        "  of which watch.unmoved()": eng.watch.unmoved,
        f"  weights check as a Python tuple compare ({len(tensors)} tensors)":
            lambda: tuple(map(data_ptr, tensors)) == ptrs,
        "  of which autocast check": engine_mod.autocast_on,
        "lock acquire and release": locked,
        "current stream id, compared": lambda: sid(idx) != eng.last_sid,
        "input copy_": lambda: plan.input.copy_(x),
        "CUDAGraph.replay()": plan.replay,
        "output clone()": lambda: plan.output.clone(),
        "owned output: take a free slot (storage use count)": lambda: plan.ring.take(sid(idx)),
        "owned output: slot graph replay (the forward into the slot)": lambda: plan.ring.take(sid(idx)).fill(),
        "owned output: a fresh view of the slot": lambda: plan.output.narrow(0, 0, 1),
        "whole gm(x), outputs=view": lambda: gv(x),
        "whole gm(x), outputs=clone": lambda: gm(x),
        "floor: copy_ + replay() + clone()": lambda: (plan.input.copy_(x), plan.replay(), plan.output.clone()),
        "floor: copy_ + slot graph replay": lambda: (plan.input.copy_(x), plan.ring.take(sid(idx)).fill()),
        "eager model(x)": lambda: model(x),
    }
    _measure(results, "gm(x) at batch 1, per piece", ops, n, repeats)


def _pipeline_step(results, device, n, repeats):
    model = SeedMLP().to(device).eval()
    gm = GraphedModule(model)
    x = torch.randn(1, 1024).pin_memory()
    xs = [x] * n
    with torch.no_grad():
        for _ in gm.pipeline(xs[:8]):
            pass
        gm(x)  # the direct call's plan, for its static buffers
    plan = gm.engine.fast_plan(x)
    static_in, static_out = plan.input, plan.output
    compute, copy = torch.cuda.current_stream(), torch.cuda.Stream()
    ev = torch.cuda.Event()
    host_out = torch.empty(static_out.shape, pin_memory=True)
    ops = {
        "engine.facts (flatten, key, checks)": lambda: gm.engine.facts((x,), {}),
        "Tensor.is_pinned()": lambda: x.is_pinned(),
        "set_stream there and back": lambda: (torch.cuda.set_stream(copy), torch.cuda.set_stream(compute)),
        "H2D copy_ from pinned, non_blocking": lambda: static_in.copy_(x, non_blocking=True),
        "Event.record": lambda: ev.record(compute),
        "Stream.wait_event": lambda: compute.wait_event(ev),
        "CUDAGraph.replay()": plan.replay,
        "clone of the output": lambda: static_out.clone(),
        "torch.empty(pin_memory=True) of the output's size": lambda: torch.empty(static_out.shape, pin_memory=True),
        "D2H copy_ into pinned, non_blocking": lambda: host_out.copy_(static_out, non_blocking=True),
    }
    _measure(results, "pipeline step at batch 1, per op", ops, n, repeats)
    with torch.no_grad():
        for to_host in (False, True):
            ts = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in gm.pipeline(xs, to_host=to_host):
                    pass
                torch.cuda.synchronize()
                ts.append((time.perf_counter() - t0) / n)
            results.add("host", "pipeline step at batch 1, per op",
                        f"whole pipeline step{', to_host' if to_host else ''} (wall, incl. GPU)", ts, "us", None, None)


def run(results, device, quick: bool, repeats: int):
    n = 200 if quick else 2000
    _direct_call(results, device, n, repeats)
    _pipeline_step(results, device, n, repeats)
