"""Scenario "compile": how long until compiled graphs answer, BERT-base fp16, seq 128.

Every row runs in a process of its own with an Inductor cache directory of its own (empty
unless the row says otherwise), so no row profits from another's compiling. Per-call times
are at batch 8, input on the GPU, median of 200 calls after warm-up.
"""

import json
import os
import subprocess
import sys
import tempfile

ROW = r'''
import json, statistics, sys, time, torch, transformers
sys.path[:0] = [ROOT]
import graphwrap
from torch._dynamo.utils import counters
torch.manual_seed(0)
cfg = transformers.BertConfig()
model = transformers.BertModel(cfg).cuda().half().eval()
ids = torch.randint(0, cfg.vocab_size, (8, 128), device="cuda")
out = {}

def per_call(fn, x):
    with torch.no_grad():
        for _ in range(20):
            fn(x)
        if hasattr(fn, "wait"):  # graphwrap: the per-size kernels of the hot bucket first
            t1 = time.perf_counter()
            fn.wait()
            out["tuning_s"] = time.perf_counter() - t1
            b = fn.stats()["keys"][0]["buckets"].get(8) or {}
            out["bucket8"] = {k: b.get(k) for k in ("kernels", "shared_us", "per_size_us")}
        ts = []
        for _ in range(5):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            for _ in range(40):
                fn(x)
            torch.cuda.synchronize(); ts.append((time.perf_counter() - t0) / 40)
    return 1e3 * statistics.median(ts)

t0 = time.perf_counter()
with torch.no_grad():
    if KIND == "torch.compile":
        cm = torch.compile(model, mode="reduce-overhead")
        cm(ids); torch.cuda.synchronize()
        out["ready_s"] = time.perf_counter() - t0
        out["ms_per_call_bs8"] = per_call(cm, ids)
    else:
        gm = graphwrap.GraphedModule(model, **KW)
        if KIND == "background":
            gm.capture(ids, background=True)
            gm(ids[:3]); torch.cuda.synchronize()
            out["first_answer_s"] = time.perf_counter() - t0
            gm.wait()
        else:
            gm.capture(ids)
        torch.cuda.synchronize()
        out["ready_s"] = time.perf_counter() - t0
        s = gm.stats()
        out["compiles"] = s["compile"]["graphs"]
        out["buckets"] = len(s["keys"][0]["buckets"])
        out["buckets_compiled"] = s["compile"]["buckets_compiled"]
        out["ms_per_call_bs8"] = per_call(gm, ids)
out["fxgraph_cache_hits"] = counters["inductor"]["fxgraph_cache_hit"]
print("ROW", json.dumps(out))
'''


def row_code(kind, kw, ready_only: bool = False) -> str:
    """The source of one row's process; ``ready_only``: no per-call timing (nor tuning) after ready."""
    code = ROW.replace("ROOT", repr(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    code = code.replace("KIND", repr(kind)).replace("KW", repr(kw))
    if ready_only:
        code = code.replace('out["ms_per_call_bs8"] = per_call(gm, ids)', "pass")
    return code


def _row(kind, kw, cache_dir):
    code = row_code(kind, kw)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1][:300] if r.stderr.strip() else f"exit {r.returncode}"}
    return json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("ROW"))[4:])


def run(results, device, quick: bool, repeats: int):
    tmp = tempfile.mkdtemp(prefix="graphwrap-compile-")
    cache = os.path.join(tmp, "bert.bin")
    rows = [
        ("torch.compile reduce-overhead, first call, one shape", "torch.compile", {}, "a"),
        ("graphwrap compile=True, max_batch_size=32", "graphwrap", {"compile": True, "max_batch_size": 32}, "b"),
        ("graphwrap compile=True, default buckets", "graphwrap", {"compile": True}, "c"),
        ("graphwrap compile=True, max_batch_size=32, saving the cache", "graphwrap",
         {"compile": {"cache": cache}, "max_batch_size": 32}, "d"),
        ("same, a new process, fresh Inductor cache dir, the saved cache loaded", "graphwrap",
         {"compile": {"cache": cache}, "max_batch_size": 32}, "e"),
        ("graphwrap compile=True, max_batch_size=32, background=True", "background",
         {"compile": True, "max_batch_size": 32}, "f"),
        ("graphwrap compile={'dynamic': False}, one bucket (8): kernels for its shape", "graphwrap",
         {"compile": {"dynamic": False}, "buckets": [8]}, "g"),
    ]
    if quick:
        rows = rows[:2]
    for name, kind, kw, d in rows:
        r = _row(kind, kw, os.path.join(tmp, f"inductor-{d}"))
        print(f"  [compile] {name}: {r}", flush=True)
        if "error" in r:
            results.add("compile", "BERT-base fp16 seq 128", name, [], "s", None, None, error=r["error"])
            continue
        results.note("compile", "BERT-base fp16 seq 128", name, r["ready_s"], "s", **{k: v for k, v in r.items()
                                                                                   if k != "ready_s"})
