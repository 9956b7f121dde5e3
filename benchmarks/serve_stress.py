"""Many streamed requests through ``python -m graphwrap serve``, some of whose clients hang up
mid-stream: does every other request end whole, and is the server back to idle after?

10,000 requests by default, ``--concurrency`` at a time spread over client processes, prompts
drawn from 64 (so each prompt's greedy text is seen many times), ``max_tokens`` 16 to 128; a
``--drop`` share of clients close their stream after a few chunks. Every request that was not
dropped must end with a finish reason, its usage and ``[DONE]``, its text what the other
requests of the same prompt and length got (greedy: the same tokens in any batch, where the
GPU's kernels round alike: reported, not required). After the run, ``/metrics`` must show no
sequence running or queued, no cache block in use, and the GPU memory of the warm server before
the run, but for graphs captured meanwhile.

    python3 benchmarks/serve_stress.py --model gpt2 --requests 10000 --out DIR
"""

import argparse
import asyncio
import collections
import concurrent.futures
import json
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_openai import ROOT, make_model, stop, wait_ready  # noqa: E402


def metrics(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


async def one(client, model: str, req: dict) -> dict:
    stream = await client.completions.create(model=model, prompt=req["prompt"], max_tokens=req["max_tokens"],
                                             temperature=0, stream=True, stream_options={"include_usage": True})
    text, finish, usage, chunks = "", None, None, 0
    async for chunk in stream:
        if chunk.choices:
            chunks += 1
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if req["drop"] is not None and chunks >= req["drop"]:
            await stream.close()
            return {"key": req["key"], "dropped": True}
    return {"key": req["key"], "dropped": False, "text": text, "finish": finish, "usage": usage}


async def _run(base: str, model: str, reqs: list, concurrency: int) -> list:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def guarded(r):
        async with gate:
            try:
                return await one(client, model, r)
            except Exception as e:  # noqa: BLE001 - counted as a failure, with its words
                return {"key": r["key"], "dropped": False, "error": f"{type(e).__name__}: {e}"}

    out = await asyncio.gather(*(guarded(r) for r in reqs))
    await client.close()
    return list(out)


def _part(args) -> list:
    return asyncio.run(_run(*args))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", choices=("gpt2", "llama-1b"))
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=256, help="streams open at once, over every client process")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--drop", type=float, default=0.1, help="share of clients that hang up mid-stream")
    ap.add_argument("--fp32", action="store_true", help="fp32 weights (default fp16 on a GPU)")
    ap.add_argument("--port", type=int, default=8931)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = make_model(a.model, tempfile.mkdtemp(prefix=f"stress-{a.model}-"), device, a.fp32)
    rng = random.Random(0)
    prompts = [" ".join(f"w{rng.randrange(100, 30000)}" for _ in range(rng.randint(8, 64))) for _ in range(64)]
    reqs = []
    for i in range(a.requests):
        p, m = rng.randrange(64), rng.choice((16, 64, 128))
        reqs.append({"prompt": prompts[p], "max_tokens": m, "key": (p, m),
                     "drop": rng.randint(1, 8) if rng.random() < a.drop else None})
    out_dir = a.out or tempfile.mkdtemp(prefix="serve-stress-")
    os.makedirs(out_dir, exist_ok=True)
    log = open(os.path.join(out_dir, f"server-stress-{a.model}.log"), "w")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "graphwrap", "serve", model_dir, "--port", str(a.port),
                             "--served-model-name", "m", "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                            env=env)
    try:
        wait_ready(a.port, proc, 300)
        base = f"http://127.0.0.1:{a.port}/v1"
        k = a.clients
        with concurrent.futures.ProcessPoolExecutor(k, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_part, [(base, "m", reqs[:64], 64)]))  # warm: every prompt once
            time.sleep(1.0)
            before = metrics(a.port)
            t0 = time.perf_counter()
            got = [o for part in pool.map(_part, [(base, "m", reqs[i::k], a.concurrency // k) for i in range(k)])
                   for o in part]
            wall = time.perf_counter() - t0
        time.sleep(2.0)
        after = metrics(a.port)
    finally:
        stop(proc)
    texts = collections.defaultdict(collections.Counter)
    kept = [g for g in got if not g["dropped"]]
    errors = [g for g in kept if "error" in g]
    whole = [g for g in kept if "error" not in g and g["finish"] in ("length", "stop") and g["usage"] is not None]
    for g in whole:
        texts[g["key"]][g["text"]] += 1
    differing = sum(sum(c.values()) - max(c.values()) for c in texts.values())
    idle = {name: after.get(f"graphwrap_{name}") for name in ("sequences_running", "sequences_queued",
                                                             "cache_blocks_used", "requests_running")}
    report = {
        "model": a.model, "device": torch.cuda.get_device_name(0) if device == "cuda" else "CPU",
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "requests": a.requests,
        "dropped": len(got) - len(kept), "kept": len(kept), "whole": len(whole), "errors": len(errors),
        "error_examples": [e["error"] for e in errors[:5]],
        "texts_differing_from_their_prompt_s_most_common": differing, "wall_s": wall,
        "idle_after": idle,
        "gpu_memory_before": before.get("graphwrap_gpu_memory_allocated_bytes"),
        "gpu_memory_after": after.get("graphwrap_gpu_memory_allocated_bytes"),
        "graph_bytes_before": before.get("graphwrap_graph_bytes"), "graph_bytes_after": after.get("graphwrap_graph_bytes"),
        "fp32": a.fp32, "drop": a.drop,
    }
    grown = None
    if report["gpu_memory_before"] is not None:  # what graphs captured meanwhile hold is the batch's to keep
        grown = (report["gpu_memory_after"] - report["gpu_memory_before"]
                 - (report["graph_bytes_after"] - report["graph_bytes_before"]))
    report["memory_grown_besides_graphs"] = grown
    with open(os.path.join(out_dir, f"serve-stress-{a.model}.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    ok = (not errors and len(whole) == len(kept) and all(v == 0 for v in idle.values())
          and (grown is None or grown <= 2**20))
    print("stress:", "passed" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
