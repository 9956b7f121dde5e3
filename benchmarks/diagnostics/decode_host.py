"""Where gm.generate's decode loop spends host time: one generate of 128 tokens on GPT-2 fp16
(batch 1) under cProfile, after a warm call; the functions with the most time, and ms per
token beside the step captured by hand."""
import cProfile
import pstats
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import decode  # noqa: E402

import graphwrap.capture.slots  # noqa: E402
from graphwrap import GraphedModule  # noqa: E402

slots = []
_make = graphwrap.capture.slots.OutputRing.make


def _counted(self, *a, **k):
    slots.append(1)
    return _make(self, *a, **k)


graphwrap.capture.slots.OutputRing.make = _counted

model = decode._model("gpt2", "cuda")
ids = torch.randint(3, model.config.vocab_size, (1, decode.PROMPT), device="cuda")
kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, cache_implementation="static")
gm = GraphedModule(model)
hand = decode._by_hand(model, ids, decode.NEW)
with torch.no_grad():
    for i in range(4):
        gm.generate(**kw, max_new_tokens=decode.NEW)
        print(f"generate {i}: {len(slots)} output slots made so far", flush=True)
    for name, fn in (("gm.generate", lambda n: gm.generate(**kw, max_new_tokens=n)), ("by hand", hand)):
        ts = []
        for n in (decode.NEW, 1) * 3:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(n)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        per = sorted((ts[i] - ts[i + 1]) / (decode.NEW - 1) for i in range(0, 6, 2))
        print(f"{name}: {1e3 * per[1]:.3f} ms/token", flush=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pr = cProfile.Profile()
    pr.enable()
    gm.generate(**kw, max_new_tokens=decode.NEW)
    pr.disable()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    print(f"output slots made: {len(slots)}; stats: {gm.stats()['keys'][0]['buckets']}")
    print(f"under the profiler: host {1e3 * host:.1f} ms, with the GPU {1e3 * (time.perf_counter() - t0):.1f} ms")
st = pstats.Stats(pr)
st.sort_stats("tottime").print_stats(30)
st.sort_stats("cumulative").print_stats(60)
