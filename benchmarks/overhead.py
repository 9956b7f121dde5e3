"""Scenario "overhead": microseconds per call at batch 1, input already on the GPU.

Beside graphwrap: eager, a bare ``graph.replay()`` of the same model, and the floor of
graphwrap's own path, its pieces each timed alone in the same process (one input ``copy_``,
one ``replay()``, one ``clone()`` of the output) and together in one loop.
"""

import torch
from harness import Case
from torch import nn
from workloads import SeedMLP, capture

from graphwrap import GraphedModule

PEER = "torch.compile reduce-overhead"


def _models():
    yield "nn.Linear(64, 64)", nn.Linear(64, 64), 64, False
    yield "seed MLP", SeedMLP(), 1024, True


def run(results, device, quick: bool, repeats: int):
    calls = 300 if quick else 2000
    for name, model, width, with_peer in _models():
        model = model.to(device).eval()
        x = torch.randn(1, width, device=device)
        case = Case(results, "overhead", f"{name} bs 1", unit="us", per=calls)

        def calls_of(fn):
            def loop():
                for _ in range(calls):
                    fn(x)
            return loop

        def by_hand(body):
            """A loop over a graph captured by hand; ``body(static_in, graph, static_out)``."""
            def setup():
                static = x.clone()
                g, out = capture(model, static)
                return body(static, g, out)
            return setup

        def replays(static, g, out):
            def loop():
                for _ in range(calls):
                    g.replay()
            return loop

        def copies(static, g, out):
            def loop():
                for _ in range(calls):
                    static.copy_(x)
            return loop

        def clones(static, g, out):
            def loop():
                for _ in range(calls):
                    out.clone()
            return loop

        def copy_replay(clone):
            def body(static, g, out):
                def loop():
                    for _ in range(calls):
                        static.copy_(x)
                        g.replay()
                        if clone:
                            out.clone()
                return loop
            return body

        with torch.no_grad():
            # Graphs captured by hand go last: torch.compile and graphwrap clear cuBLAS workspaces
            # when they capture (see fixed.py).
            if with_peer and not quick:
                case.add(PEER, lambda: calls_of(torch.compile(model, mode="reduce-overhead")))
            gms = {}
            for outputs in ("view", "clone"):
                for faster in (True, False):
                    label = f"graphwrap outputs={outputs}" + ("" if faster else ", eager_if_faster=False")
                    gm = gms[label] = GraphedModule(model, outputs=outputs, eager_if_faster=faster)
                    case.add(label, lambda gm=gm: calls_of(gm))
            case.add("eager", lambda: calls_of(model))
            case.add("bare graph.replay()", by_hand(replays))
            case.add("input copy_ alone", by_hand(copies))
            case.add("output clone() alone", by_hand(clones))
            case.add("floor: copy_ + replay() in one loop", by_hand(copy_replay(False)))
            case.add("floor: copy_ + replay() + clone() in one loop", by_hand(copy_replay(True)))
            times = case.run(repeats)
        med = {k: sorted(v)[len(v) // 2] * 1e6 for k, v in times.items()}
        floor_view = med["input copy_ alone"] + med["bare graph.replay()"]
        floor_clone = floor_view + med["output clone() alone"]
        results.note("overhead", case.case, "floor (view): copy_ + replay(), each alone, summed", floor_view, "us")
        results.note("overhead", case.case, "floor (clone): copy_ + replay() + clone(), each alone, summed",
                     floor_clone, "us")
        for label, gm in gms.items():
            b = gm.stats()["keys"][0]["buckets"][1]
            print(f"  [{case.case}] {label}: bucket 1 serves {b['serves']} (graph {b['graph_us']:.1f} us, "
                  f"eager {b['eager_us']:.1f} us a call at capture)" if b["graph_us"] is not None else
                  f"  [{case.case}] {label}: bucket 1 serves {b['serves']}", flush=True)
        del gms
