"""Scenario "mixed": batch sizes drawn at random, pinned host data.

The seed MLP at two widths (sizes 1..64) and BERT-base at seq 128 in fp16 (sizes 1..32), each
served by eager, torch.compile reduce-overhead, and graphwrap with its bucket policies, with
and without compiled kernels.
"""

import collections

import torch
from harness import Case
from workloads import SeedMLP

from graphwrap import Adaptive, GraphedModule

PEER = "torch.compile reduce-overhead dynamic=None"


def _to(item, device):
    if isinstance(item, dict):
        return {k: v.to(device, non_blocking=True) for k, v in item.items()}
    return item.to(device, non_blocking=True)


def _loop(fn, data, device):
    def loop():
        for item in data:
            x = _to(item, device)
            fn(**x) if isinstance(x, dict) else fn(x)
    return loop


def _compiled(model, data, device, dynamic):
    return _loop(torch.compile(model, mode="reduce-overhead", dynamic=dynamic), data, device)


def _pipeline(gm, data):
    def loop():
        for _ in gm.pipeline(data):
            pass
    return loop


def _graphwrap(case, results, model, data, name, histogram, **kw):
    """Add a graphwrap pipeline strategy; note its pool memory, padding and compile time."""
    gms = {}

    def setup():
        gms["gm"] = GraphedModule(model, **kw)
        return _pipeline(gms["gm"], data)

    case.add(name, setup)
    gm = gms.get("gm")
    if gm is None:
        return
    s = gm.stats()
    extra = {"buckets": len(s["buckets"] or []), "padded_share": s["padded_share"]}
    if s["compile"]:
        extra.update(compile_s=s["compile"]["compile_s"], compiled_graphs=s["compile"]["graphs"],
                     compile_off=s["compile"]["off"])
    results.note(case.scenario, case.case, f"{name}: graph pool MiB", s["graph_pool_bytes"] / 2**20, "MiB", **extra)


def _policies(case, results, model, data, sizes, plain_exact=True, static_exact=False):
    # Exact buckets compile with a dynamic batch dimension (one compile serves every bucket)
    # and, where asked, with kernels compiled for each size (one compile per size).
    hist = dict(collections.Counter(sizes))
    _graphwrap(case, results, model, data, "graphwrap pipeline", hist)
    if plain_exact:
        _graphwrap(case, results, model, data, "graphwrap pipeline exact", hist, buckets="exact",
                   max_batch_size=max(sizes))
    _graphwrap(case, results, model, data, "graphwrap pipeline compile=True", hist, compile=True)
    _graphwrap(case, results, model, data, "graphwrap pipeline compile=dynamic exact", hist,
               compile={"dynamic": True}, buckets="exact", max_batch_size=max(sizes))
    if static_exact:
        _graphwrap(case, results, model, data, "graphwrap pipeline compile=True exact", hist,
                   compile=True, buckets="exact", max_batch_size=max(sizes))
    _graphwrap(case, results, model, data, "graphwrap pipeline compile=True Adaptive(k=8)", hist,
               compile=True, buckets=Adaptive(k=8, histogram=hist))


def run(results, device, quick: bool, repeats: int, models=("mlp", "bert"), static_exact=False):
    if "mlp" in models:
        _mlp(results, device, quick, repeats, static_exact)
    if "bert" in models:
        _bert(results, device, quick, repeats)


def _mlp(results, device, quick, repeats, static_exact):
    count = 400 if quick else 2000
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 65, (count,), generator=g).tolist()
    for hidden in (1024, 4096):
        torch.manual_seed(0)
        model = SeedMLP(hidden=hidden).to(device).eval()
        data = [torch.randn(n, 1024, generator=g).pin_memory() for n in sizes]
        case = Case(results, "mixed", f"MLP hidden {hidden}, sizes 1..64")
        with torch.no_grad():
            case.add("eager", lambda: _loop(model, data, device))
            torch._dynamo.reset()
            case.add(PEER, lambda: _compiled(model, data, device, None))
            torch._dynamo.reset()
            gm = GraphedModule(model)
            case.add("graphwrap gm(x) loop", lambda: (lambda: [gm(x) for x in data] and None))
            _policies(case, results, model, data, sizes, static_exact=static_exact)
            case.run(repeats)
        data = case = gm = None  # let go of this round's models and data before the next
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def _bert(results, device, quick, repeats):
    try:
        import transformers as tr
    except ImportError:
        return
    count = 200 if quick else 2000
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 33, (count,), generator=g).tolist()
    torch.manual_seed(0)
    model = tr.BertModel(tr.BertConfig()).to(device).half().eval()
    data = []
    for n in sizes:
        ids = torch.randint(0, 30000, (n, 128), generator=g)
        data.append({"input_ids": ids.pin_memory(), "attention_mask": torch.ones_like(ids).pin_memory()})
    case = Case(results, "mixed", "BERT-base fp16 seq 128, sizes 1..32")
    with torch.no_grad():
        torch._dynamo.reset()
        case.add(PEER, lambda: _compiled(model, data, device, None))
        torch._dynamo.reset()
        # No eager row here: 2000 eager BERT batches take about 12 s a round (the models
        # scenario has eager BERT per call).
        _policies(case, results, model, data, sizes, plain_exact=False)
        case.run(repeats)
    data = case = model = None  # let go of this round's models and data before the next
    torch._dynamo.reset()
    torch.cuda.empty_cache()
