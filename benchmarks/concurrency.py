"""Scenario "concurrency": many requests at once on a 7-8B shape, by how many rows a step holds.

N requests of 128 random prompt tokens and 128 new tokens (greedy, no end-of-sequence token)
are submitted at once (``gm.submit_generate``, one thread), for each N of ``--concurrency``.
Each batch setting in turn, in this one process, on one model: ``decode={"rows": 64}`` (the
default before rows followed memory) and the default (rows from the pool's memory, see
``graphwrap/decoding/cache/pool.py``). For each: the first burst of each N, timed apart (it captures
the shapes it needs), then the median of ``--repeats`` warm bursts, with their spread, in
output tokens/s. Between settings the batch is closed and dropped, and the GPU memory the
process holds is read without the garbage collector running (the pool must be back then).

``python3 benchmarks/concurrency.py [--model llama3-8b] [--concurrency 256,1024]`` on a GPU.
"""

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate_large import big_model  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402

PROMPT, NEW = 128, 128


def requests(n: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, PROMPT), generator=g) for _ in range(n)]


def burst(gm, prompts, device) -> float:
    ids = [p.to(device) for p in prompts]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    futs = [gm.submit_generate(input_ids=x, max_new_tokens=NEW, do_sample=False) for x in ids]
    outs = [f.result() for f in futs]
    dt = time.perf_counter() - t0
    assert all(o.shape[1] == PROMPT + NEW for o in outs)
    return dt


def one_setting(model, label: str, decode, levels, repeats: int, device) -> dict:
    gm = GraphedModule(model, decode=decode)
    out = {"setting": label, "decode": decode}
    for n in levels:
        prompts = requests(n, model.config.vocab_size, seed=n)
        first = burst(gm, prompts, device)
        # (each warm burst's prompts its own: a prompt sent again is served from the prefix cache)
        warm = [burst(gm, requests(n, model.config.vocab_size, seed=n + 1000 * (r + 1)), device) for r in range(repeats)]
        tokens = n * NEW
        m = statistics.median(warm)
        out[n] = {"first_s": round(first, 3), "warm_s": [round(t, 3) for t in warm],
                  "first_tokens_s": round(tokens / first), "tokens_s": round(tokens / m),
                  "tokens_s_spread": [round(tokens / max(warm)), round(tokens / min(warm))]}
        print(f"{label}: {n} at once: first burst {first:.2f} s ({tokens / first:,.0f} tokens/s), warm "
              f"{tokens / m:,.0f} tokens/s (median of {repeats}: {min(warm):.2f}-{max(warm):.2f} s)", flush=True)
    d = gm.stats()["decode"]
    out["rows"], out["cache_bytes"] = d["rows"], d["cache_bytes"]
    out["rows_per_step"], out["preempted"] = round(d["rows_per_step"], 1), d["preempted"]
    out["captures"] = d["captures"]
    out["decode_thread_s"], out["steps"], out["prefills"] = d["thread_s"], d["steps"], d["prefills"]
    out["rows_per_prefill"], out["turn_ms"], out["tpot_ms"] = round(d["rows_per_prefill"], 1), d["turn_ms"], d["tpot_ms"]
    print(f"{label}: the decode thread's seconds by part {d['thread_s']}; {d['steps']} steps, {d['prefills']} prompt "
          f"forwards of {d['rows_per_prefill']:.1f} prompts; turn p50 {d['turn_ms']['p50']:.2f} ms, time per output "
          f"token p50 {d['tpot_ms']['p50']:.2f} ms", flush=True)
    print(f"{label}: rows {d['rows']}, cache {d['cache_bytes'] / 2**30:.1f} GiB, rows a step {d['rows_per_step']:.1f}, "
          f"preempted {d['preempted']}, captures {d['captures']}", flush=True)
    held = torch.cuda.memory_allocated()
    gc.disable()  # the batch's memory must come back without the collector
    try:
        gm.close()
        del gm
        time.sleep(0.5)
        out["allocated_before_close_gib"] = round(held / 2**30, 2)
        out["allocated_after_close_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    finally:
        gc.enable()
    print(f"{label}: GPU memory allocated {held / 2**30:.1f} GiB before close, "
          f"{out['allocated_after_close_gib']:.1f} after (no garbage collection)", flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--concurrency", default="256,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settings", default="rows64,default")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device("cuda")
    levels = [int(x) for x in a.concurrency.split(",")]
    model = big_model(a.model, device)
    head = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": str(datetime.date.today()),
            "model": a.model, "prompt": PROMPT, "new": NEW, "repeats": a.repeats}
    print(head, flush=True)
    settings = {"rows64": {"rows": 64}, "default": None, "rows256": {"rows": 256}}
    results = [one_setting(model, s, settings[s], levels, a.repeats, device) for s in a.settings.split(",")]
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**head, "results": results}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
