"""Scenario "replicas": the same closed-loop clients as "serving", one GPU against every GPU.

``graphwrap.Replicas`` over the first device, then over all of them, in the same process;
64 client threads, and 64 coroutines of one asyncio event loop; batch-1 requests whose inputs
are on the host (as they arrive from the network).
"""

import torch
from serving import _coroutines, _models, _threads

from graphwrap import Replicas


def run(results, device, quick: bool, repeats: int, models=("mlp", "bert"), clients=64):
    seconds = 0.5 if quick else 2.0
    n_gpus = torch.cuda.device_count()
    if n_gpus < 2:
        print(f"  [replicas] {n_gpus} CUDA device(s): this scenario needs two or more", flush=True)
        return
    for name, model, make_input, gm_kw in _models(torch.device("cpu"), models):
        per = {}
        for k in (1, n_gpus):
            reps = Replicas(model, devices=[f"cuda:{i}" for i in range(k)], **gm_kw)
            x = make_input()
            with torch.no_grad():
                reps.capture(x)
                _threads(reps, make_input, 16, 0.3)  # warm up (the probe, joined buckets)
                _coroutines(reps, make_input, 64, 0.3)
                for mode, fn in (("threads", _threads), ("asyncio", _coroutines)):
                    before = _counts(reps)
                    rps, lat = fn(reps, make_input, clients, seconds)
                    requests, calls = (a - b for a, b in zip(_counts(reps), before))
                    per[(k, mode)] = rps
                    results.note("replicas", f"{name}, {clients} clients, {mode}", f"{k} GPU(s)", rps, "req/s")
                    print(f"  [replicas] {name} {mode:8s} {k} GPU(s): {rps:10.0f} req/s, "
                          f"{requests / max(calls, 1):.1f} requests per module call", flush=True)
            reps.close()
            del reps
            torch.cuda.empty_cache()
        for mode in ("threads", "asyncio"):
            ratio = per[(n_gpus, mode)] / per[(1, mode)]
            print(f"  [replicas] {name} {mode}: {n_gpus} GPUs / 1 GPU = {ratio:.2f}x", flush=True)


def _counts(reps):
    """Requests and module calls so far, summed over the replicas."""
    per = [d["batcher"] for d in reps.stats().values()]
    return sum(b["requests"] for b in per), sum(b["module_calls"] for b in per)
