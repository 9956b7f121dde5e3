"""Scenario "fixed": the seed's comparison. Seed MLP, batches in pinned host memory, fixed size."""

import copy

import torch
from harness import Case
from workloads import (
    SeedMLP,
    copy_floor,
    d2h_floor,
    double_buffered_loop,
    graph_loop,
    replay_floor,
    stream_loop,
    sync_loop,
)

import graphwrap.loops.pipeline as gw_pipeline
from graphwrap import GraphedModule

BASELINE = "seed synchronous loop"
PEER = "torch.compile reduce-overhead"


def _compiled(model, cpu_data, device):
    cm = torch.compile(model, mode="reduce-overhead")

    def loop():
        for data in cpu_data:
            cm(data.to(device, non_blocking=True))
    return loop


def _make_graphed(model, cpu_data, device):
    # make_graphed_callables replaces the forward of the module it is given: give it a copy.
    model = copy.deepcopy(model).requires_grad_(False)
    sample = torch.randn(cpu_data[0].shape, device=device)
    g = torch.cuda.make_graphed_callables(model, (sample,))

    def loop():
        for data in cpu_data:
            g(data.to(device, non_blocking=True))
    return loop


def _pipeline_with(gm, cpu_data, to_host=False, **settings):
    """The pipeline with some of graphwrap.loops.pipeline's size thresholds changed, for comparison."""
    def loop():
        old = {k: getattr(gw_pipeline, k) for k in settings}
        for k, v in settings.items():
            setattr(gw_pipeline, k, v)
        try:
            for _ in gm.pipeline(cpu_data, to_host=to_host):
                pass
        finally:
            for k, v in old.items():
                setattr(gw_pipeline, k, v)
    return loop


def run(results, device, quick: bool, repeats: int, batch_sizes=(1, 16, 256, 1280)):
    num_batches = 128 if quick else 1280
    for bs in batch_sizes:
        torch.manual_seed(0)
        model = SeedMLP().to(device).eval()
        cpu_data = [torch.randn(bs, 1024).pin_memory() for _ in range(num_batches)]
        case = Case(results, "fixed", f"bs {bs}")
        # max_batch_size=bs: one bucket holds the whole batch (the default rows below do not)
        gm = GraphedModule(model, max_batch_size=max(bs, 256))
        gm_host = GraphedModule(model, max_batch_size=max(bs, 256))
        gm_view = GraphedModule(model, max_batch_size=max(bs, 256), outputs="view")
        with torch.no_grad():
            # torch.compile's CUDA graphs and graphwrap clear PyTorch's cuBLAS workspaces when they
            # capture, which would leave graphs captured by hand before them pointing at freed
            # memory: they capture first.
            case.add(PEER, lambda: _compiled(model, cpu_data, device))
            case.add("graphwrap gm(x) loop", lambda: (lambda: [gm(x) for x in cpu_data] and None))
            case.add("graphwrap gm(x) loop outputs=view", lambda: (lambda: [gm_view(x) for x in cpu_data] and None))
            case.add("graphwrap pipeline", lambda: (lambda: [None for _ in gm.pipeline(cpu_data)] and None))
            case.add("graphwrap pipeline coalesce=True",
                     lambda: (lambda: [None for _ in gm.pipeline(cpu_data, coalesce=True)] and None))
            case.add("graphwrap pipeline outputs=view",
                     lambda: (lambda: [None for _ in gm_view.pipeline(cpu_data)] and None))
            case.add("graphwrap pipeline to_host", lambda: (lambda: [None for _ in gm_host.pipeline(cpu_data, to_host=True)] and None))
            case.add("graphwrap pipeline to_host, every D2H on the third stream",
                     lambda: _pipeline_with(gm_host, cpu_data, to_host=True, D2H_INLINE_BYTES=-1))
            if bs > 256:
                # A user's first run: the default largest bucket (256), so these batches are chunked.
                gm_default = GraphedModule(model)
                case.add("graphwrap gm(x) loop, default settings", lambda: (lambda: [gm_default(x) for x in cpu_data]
                                                                             and None))
                case.add("graphwrap pipeline, default settings",
                         lambda: (lambda: [None for _ in gm_default.pipeline(cpu_data)] and None))

            case.add(BASELINE, lambda: sync_loop(model, cpu_data, device))
            case.add("seed stream loop", lambda: stream_loop(model, cpu_data, device))
            case.add("seed graph loop", lambda: graph_loop(model, cpu_data, device))
            case.add("make_graphed_callables", lambda: _make_graphed(model, cpu_data, device))
            case.add("hand-written double-buffered graphs", lambda: double_buffered_loop(model, cpu_data, device))
            case.add("floor: replays alone", lambda: replay_floor(model, cpu_data, device))
            case.add("floor: H2D copies alone", lambda: copy_floor(cpu_data, device))
            case.add("floor: D2H copies alone", lambda: d2h_floor((bs, 512), num_batches, device))
            case.run(repeats)
        cpu_data = case = gm = gm_host = gm_view = None  # let go of this round's models and data before the next
        torch.cuda.empty_cache()
