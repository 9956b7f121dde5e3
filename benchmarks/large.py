"""Scenario "large": batches above the largest bucket, default settings (largest bucket 256).

The seed MLP over 200 batches in pinned host memory. The floor is one graph captured for the
whole batch size, replayed alone (no copies).
"""

import torch
from harness import Case
from workloads import SeedMLP, chunk_floor, replay_floor, sync_loop

from graphwrap import GraphedModule


def run(results, device, quick: bool, repeats: int, batch_sizes=(300, 512, 1280)):
    num_batches = 50 if quick else 200
    for bs in batch_sizes:
        torch.manual_seed(0)
        model = SeedMLP().to(device).eval()
        cpu_data = [torch.randn(bs, 1024).pin_memory() for _ in range(num_batches)]
        case = Case(results, "large", f"bs {bs}")
        gm = GraphedModule(model)
        chunked = GraphedModule(model, eager_if_faster=False)  # always chunks of graphs
        with torch.no_grad():
            case.add("graphwrap gm(x) loop", lambda: (lambda: [gm(x) for x in cpu_data] and None))
            case.add("graphwrap pipeline", lambda: (lambda: [None for _ in gm.pipeline(cpu_data)] and None))
            case.add("graphwrap pipeline, eager_if_faster=False (chunks)",
                     lambda: (lambda: [None for _ in chunked.pipeline(cpu_data)] and None))
            case.add("eager loop m(x.to(cuda))", lambda: sync_loop(model, cpu_data, device))
            case.add("floor: one graph of that size, replays alone", lambda: replay_floor(model, cpu_data, device))
            case.add("floor: chunks of 256 rows, replays alone", lambda: chunk_floor(model, cpu_data, device))
            case.run(repeats)
        print(f"  [{case.case}] graphwrap serves these batches: {gm.stats()['keys'][0]['large_batches']}", flush=True)
        cpu_data = case = gm = chunked = None  # let go of this round's models and data before the next
        torch.cuda.empty_cache()
