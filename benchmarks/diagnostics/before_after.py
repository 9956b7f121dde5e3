"""Per-call host cost of this graphwrap beside an earlier one, in one process.

``python benchmarks/diagnostics/before_after.py PATH``: PATH holds the earlier package as
``graphwrap_before/`` (e.g. ``git archive <commit> graphwrap | tar -x -C PATH`` and rename).
Batch 1, input on the GPU, µs per call: eager, a bare replay, and each graphwrap with owned
and view outputs, with each output dropped and with every output of a round kept by the caller;
rounds interleaved, medians with min and max. Also an eager fallback (an input graphwrap cannot
key on, as a model's cache object) beside the module's own call, and BERT-base (about 200
submodules, keyword inputs) where the host time to issue a call is timed apart from the device's.
"""

import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".old")
sys.path.insert(0, ".")
import graphwrap_before  # noqa: E402

import graphwrap  # noqa: E402

DEV = "cuda"
# GW_BEFORE_FIRST=1 times the earlier package first in each round (the order is otherwise after,
# before): a difference that follows the order, not the package, is the machine's.
BEFORE_FIRST = os.environ.get("GW_BEFORE_FIRST") == "1"


def _ordered(d: dict) -> dict:
    """``d`` with its "before" entries ahead of its "after" ones where ``GW_BEFORE_FIRST`` says so."""
    if not BEFORE_FIRST:
        return d
    return dict(sorted(d.items(), key=lambda kv: {"before": 0, "after": 1}.get(kv[0].split(",")[0].split(" ")[0], -1)))


class Seed(nn.Module):
    def __init__(self, d=1024):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(),
                                    nn.Linear(d, 512))

    def forward(self, x):
        return self.layers(x)


class Cache:
    """An object graphwrap cannot key on, holding tensors (as a decoder's cache)."""

    def __init__(self):
        self.k = [torch.zeros(1, 64, device=DEV) for _ in range(24)]


class TakesCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x, cache):
        return self.lin(x) + cache.k[0]


def _loop(fn, calls):
    def run():
        for _ in range(calls):
            fn()
    return run


def _time(loops, rounds=31, calls=2000, issue_only=False):
    """µs per call of each loop (``calls`` calls), rounds interleaved: (median, min, max). With
    ``issue_only`` the clock stops once the calls are issued (the device drained before each
    round, not waited for inside it): the host time to issue a call."""
    for f in loops.values():
        f()
    torch.cuda.synchronize()
    times = {k: [] for k in loops}
    for _ in range(rounds):
        for k, f in loops.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            if not issue_only:
                torch.cuda.synchronize()
            times[k].append((time.perf_counter() - t0) / calls * 1e6)
    return {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}


def _kept(fn, calls):
    def run():
        outs = []
        for _ in range(calls):
            outs.append(fn())
    return run


def _bert(calls=200):
    try:
        import transformers
    except ImportError:
        print("\nBERT-base: transformers is not installed")
        return
    model = transformers.BertModel(transformers.BertConfig()).to(DEV).half().eval()
    ids = torch.randint(1, 30000, (1, 128), device=DEV)
    mask = torch.ones_like(ids)
    kw = {"input_ids": ids, "attention_mask": mask}
    after, before = graphwrap.GraphedModule(model), graphwrap_before.GraphedModule(model)
    with torch.no_grad():
        after(**kw), before(**kw)
        res = _time(_ordered({"eager": _loop(lambda: model(**kw), calls),
                              "after, default": _loop(lambda: after(**kw), calls),
                              "before, default": _loop(lambda: before(**kw), calls)}), rounds=11, calls=calls,
                    issue_only=True)
    print(f"\nBERT-base fp16, batch 1 x 128 tokens, keyword inputs, {sum(1 for _ in model.modules())} modules: "
          f"µs to issue a call (median [min, max] of 11 rounds of {calls}; a replay's hundreds of kernels fill the "
          "launch queue, so this is the device's time)")
    for k, (med, lo, hi) in res.items():
        print(f"  {k:18s} {med:7.2f}  [{lo:.2f}, {hi:.2f}]")
    # The host side of the same call alone: the general path's per-call checks (facts) and the
    # lookup of the plan, which is where the module's state is checked.
    ea, eb = after.engine, before.engine
    fa, fb = ea.facts((), kw), eb.facts((), kw)
    pieces = {"after: facts() (every per-call check)": lambda: ea.facts((), kw),
              "before: facts()": lambda: eb.facts((), kw),
              "after: facts() + plan()": lambda: ea.plan(ea.facts((), kw)),
              "before: facts() + plan()": lambda: eb.plan(eb.facts((), kw))}
    res = _host(pieces)
    print(f"  host µs per call, {type(fa).__name__} / {type(fb).__name__} (median [min, max] of 11 rounds of 20000)")
    for k, (med, lo, hi) in res.items():
        print(f"  {k:38s} {med:7.3f}  [{lo:.3f}, {hi:.3f}]")


def _host(pieces, rounds=11, calls=20000):
    times = {k: [] for k in pieces}
    for _ in range(rounds):
        for k, f in pieces.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            times[k].append((time.perf_counter() - t0) / calls * 1e6)
    return {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}


def _bare(model, x):
    static = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        model(static)
    return g.replay


def main():
    calls = 2000
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
          f"{', before timed first in each round' if BEFORE_FIRST else ''}")
    for name, model, width in (("nn.Linear(64, 64)", nn.Linear(64, 64), 64), ("seed MLP", Seed(), 1024)):
        model = model.to(DEV).eval()
        x = torch.randn(1, width, device=DEV)
        gms = {
            "after, default": graphwrap.GraphedModule(model),
            "after, view": graphwrap.GraphedModule(model, outputs="view"),
            "before, default": graphwrap_before.GraphedModule(model),
            "before, view": graphwrap_before.GraphedModule(model, outputs="view"),
            # No race at capture: what serves a call whose outputs the caller keeps is then the
            # same in both (the race's choice of eager for such calls follows its own timings).
            "after, no race": graphwrap.GraphedModule(model, eager_if_faster=False),
            "before, no race": graphwrap_before.GraphedModule(model, eager_if_faster=False),
        }
        with torch.no_grad():
            for gm in gms.values():
                gm(x)
            replay = _bare(model, x)
            loops = {"eager": _loop(lambda: model(x), calls), "bare replay": _loop(replay, calls)}
            loops.update({k: _loop(lambda gm=gm: gm(x), calls) for k, gm in gms.items()})
            loops["eager, kept"] = _kept(lambda: model(x), calls)
            loops.update({k + ", kept": _kept(lambda gm=gm: gm(x), calls) for k, gm in gms.items()
                          if "default" in k or "no race" in k})
            res = _time(_ordered(loops), calls=calls)
        print(f"\n{name}, batch 1, µs per call (median [min, max] of 31 rounds of {calls})")
        for k, (med, lo, hi) in res.items():
            print(f"  {k:18s} {med:7.2f}  [{lo:.2f}, {hi:.2f}]")
        for k in gms:
            b = next(iter(gms[k].stats()["keys"][0]["buckets"].values()))
            print(f"  {k}: serves {b['serves']} (race: graph {b.get('graph_us')}, eager {b.get('eager_us')}, a replay "
                  f"and a clone {b.get('held_us')}; kept outputs served eagerly: {b.get('eager_when_held')})")
    model = TakesCache().to(DEV).eval()
    x, cache = torch.randn(1, 64, device=DEV), Cache()
    after, before = graphwrap.GraphedModule(model), graphwrap_before.GraphedModule(model)
    with torch.no_grad():
        res = _time({"module": _loop(lambda: model(x, cache), calls),
                     "after (eager fallback)": _loop(lambda: after(x, cache), calls),
                     "before (eager fallback)": _loop(lambda: before(x, cache), calls)}, calls=calls)
    print("\nan input graphwrap cannot key on (a cache object), µs per call")
    for k, (med, lo, hi) in res.items():
        print(f"  {k:24s} {med:7.2f}  [{lo:.2f}, {hi:.2f}]")
    _bert()


if __name__ == "__main__":
    main()
