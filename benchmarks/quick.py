"""Scenario "quick": one short table, about a minute on one GPU, with default settings.

Three workloads, each timed in this process beside eager: the seed MLP at batch 1 with its
input on the GPU (µs per call, with a bare ``graph.replay()`` of the same model as the floor);
the seed MLP over 300 batches of 1 to 64 rows in pinned host memory (seconds for the loop:
``gm(x)`` and ``gm.pipeline``); BERT-base fp16 at 8 x 128 tokens (ms per call; needs
transformers, left out with the reason without it).
"""

import torch
from harness import Case
from workloads import SeedMLP, capture

from graphwrap import GraphedModule


def run(results, device, quick: bool, repeats: int):
    _per_call(results, device, repeats)
    _mixed(results, device, repeats)
    _bert(results, device, repeats)


def _per_call(results, device, repeats):
    model = SeedMLP().to(device).eval()
    x = torch.randn(1, 1024, device=device)
    calls = 500
    case = Case(results, "quick", "seed MLP, batch 1, input on the GPU", unit="us", per=calls)

    def loop_of(fn):
        def loop():
            for _ in range(calls):
                fn()
        return loop

    with torch.no_grad():
        case.add("eager", lambda: loop_of(lambda: model(x)))

        def bare():
            static = x.clone()
            g, _ = capture(model, static)
            return loop_of(g.replay)

        case.add("bare graph.replay()", bare)

        def graphed():
            gm = GraphedModule(model)
            return loop_of(lambda: gm(x))

        case.add("GraphedModule(m)", graphed)
        case.run(repeats)


def _mixed(results, device, repeats):
    model = SeedMLP().to(device).eval()
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 65, (300,), generator=g).tolist()
    xs = [torch.randn(n, 1024).pin_memory() for n in sizes]
    case = Case(results, "quick", "seed MLP, 300 batches of 1-64 rows, pinned host memory")
    with torch.no_grad():
        def eager():
            def loop():
                for x in xs:
                    model(x.to(device, non_blocking=True))
            return loop

        case.add("eager", eager)
        gm = GraphedModule(model)

        def calls():
            def loop():
                for x in xs:
                    gm(x)
            return loop

        def pipeline():
            def loop():
                for _ in gm.pipeline(xs):
                    pass
            return loop

        case.add("GraphedModule(m)", calls)
        case.add("gm.pipeline(batches)", pipeline)
        case.run(repeats)


def _bert(results, device, repeats):
    case = Case(results, "quick", "BERT-base fp16, 8 x 128 tokens", unit="ms", per=20)
    try:
        import transformers
    except ImportError:
        results.add("quick", case.case, "left out", [], "ms", None, None,
                    error='needs transformers: pip install transformers')
        print("  [BERT-base] left out: needs transformers", flush=True)
        return
    model = transformers.BertModel(transformers.BertConfig()).to(device).half().eval()
    ids = torch.randint(1, 30000, (8, 128), device=device)
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        case.add("eager", lambda: (lambda: [model(**kw) for _ in range(20)] and None))
        gm = GraphedModule(model)
        case.add("GraphedModule(m)", lambda: (lambda: [gm(**kw) for _ in range(20)] and None))
        case.run(repeats)
