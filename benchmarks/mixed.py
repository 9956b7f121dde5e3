"""Scenario "mixed": batch sizes drawn from 1..64, pinned host data, the seed MLP at two widths."""

import torch

from graphwrap import GraphedModule
from harness import Case
from workloads import SeedMLP

PEER = "torch.compile reduce-overhead dynamic=None"


def _eager(model, data, device):
    def loop():
        for x in data:
            model(x.to(device, non_blocking=True))
    return loop


def _compiled(model, data, device, dynamic):
    cm = torch.compile(model, mode="reduce-overhead", dynamic=dynamic)
    return _eager(cm, data, device)


def run(results, device, quick: bool, repeats: int):
    count = 400 if quick else 2000
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 65, (count,), generator=g).tolist()
    for hidden in (1024, 4096):
        torch.manual_seed(0)
        model = SeedMLP(hidden=hidden).to(device).eval()
        data = [torch.randn(n, 1024, generator=g).pin_memory() for n in sizes]
        case = Case(results, "mixed", f"hidden {hidden}")
        gm = GraphedModule(model)
        with torch.no_grad():
            case.add("eager", lambda: _eager(model, data, device))
            torch._dynamo.reset()
            case.add(PEER, lambda: _compiled(model, data, device, None))
            torch._dynamo.reset()
            case.add("torch.compile reduce-overhead dynamic=False", lambda: _compiled(model, data, device, False))
            case.add("graphwrap gm(x) loop", lambda: (lambda: [gm(x) for x in data] and None))
            case.add("graphwrap pipeline", lambda: (lambda: [None for _ in gm.pipeline(data)] and None))
            case.run(repeats)
        s = gm.stats()
        results.note("mixed", f"hidden {hidden}", "graphwrap padded share of rows", s["padded_share"], "share")
        del data, case, gm
        torch._dynamo.reset()
        torch.cuda.empty_cache()
