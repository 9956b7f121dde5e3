"""Scenario "overhead": microseconds per call at batch 1, input already on the GPU."""

import torch

from graphwrap import GraphedModule
from harness import Case
from workloads import SeedMLP, capture

PEER = "torch.compile reduce-overhead"


def run(results, device, quick: bool, repeats: int):
    calls = 300 if quick else 2000
    model = SeedMLP().to(device).eval()
    x = torch.randn(1, 1024, device=device)
    case = Case(results, "overhead", "seed MLP bs 1", unit="us", per=calls)

    def calls_of(fn):
        def loop():
            for _ in range(calls):
                fn(x)
        return loop

    def bare():
        static = x.clone()
        g, _ = capture(model, static)

        def loop():
            for _ in range(calls):
                g.replay()
        return loop

    with torch.no_grad():
        # Graphs captured by hand go last: torch.compile and graphwrap clear cuBLAS workspaces
        # when they capture (see fixed.py).
        case.add(PEER, lambda: calls_of(torch.compile(model, mode="reduce-overhead")))
        case.add("graphwrap outputs=view", lambda: calls_of(GraphedModule(model, outputs="view")))
        case.add("graphwrap outputs=clone", lambda: calls_of(GraphedModule(model)))
        case.add("eager", lambda: calls_of(model))
        case.add("bare graph.replay()", bare)
        case.run(repeats)
