"""Scenario "serving": closed-loop clients sending batch-1 requests, each waiting for its answer.

Strategies: (a) eager behind a lock, (b) threads sharing ``gm(x)``, (c) ``graphwrap.Batcher``
called from threads, (d) ``Batcher.acall`` from coroutines of one asyncio event loop. Each row
runs for a fixed time; requests/s counts answers over that time with the device synchronized
at its end; latency is the time a call takes to return (the output is on the GPU, not waited
for). Inputs are on the GPU.
"""

import asyncio
import threading
import time

import torch
from workloads import SeedMLP

from graphwrap import Batcher, GraphedModule


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _threads(fn, make_input, clients, seconds):
    stop = time.perf_counter() + seconds
    lat = [[] for _ in range(clients)]
    start = threading.Barrier(clients + 1)

    def client(i):
        x = make_input()
        mine = lat[i]
        start.wait()
        with torch.no_grad():
            while True:
                t0 = time.perf_counter()
                if t0 >= stop:
                    return
                fn(x)
                mine.append(time.perf_counter() - t0)

    ts = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    flat = [v for m in lat for v in m]
    return len(flat) / wall, flat


def _coroutines(batcher, make_input, clients, seconds):
    lat = []

    async def client(x, stop):
        while True:
            t0 = time.perf_counter()
            if t0 >= stop:
                return
            await batcher.acall(x)
            lat.append(time.perf_counter() - t0)

    async def main():
        xs = [make_input() for _ in range(clients)]
        stop = time.perf_counter() + seconds
        await asyncio.gather(*(client(x, stop) for x in xs))

    t0 = time.perf_counter()
    with torch.no_grad():
        asyncio.run(main())
    torch.cuda.synchronize()
    return len(lat) / (time.perf_counter() - t0), lat


def _models(device, which):
    if "mlp" in which:
        yield "seed MLP", SeedMLP().to(device).eval(), lambda: torch.randn(1, 1024, device=device), {}
    if "bert" in which:
        import transformers

        cfg = transformers.BertConfig()  # BERT-base
        model = transformers.BertModel(cfg).to(device).half().eval()
        yield ("BERT-base fp16 seq 128", model,
               lambda: torch.randint(0, cfg.vocab_size, (1, 128), device=device), {"max_batch_size": 64})


def run(results, device, quick: bool, repeats: int, models=("mlp", "bert"), clients=(1, 4, 16, 64, 256)):
    seconds = 0.5 if quick else 1.5
    rows = []
    for name, model, make_input, gm_kw in _models(device, models):
        gm = GraphedModule(model, **gm_kw)
        with torch.no_grad():
            x = make_input()
            gm.capture(x)  # every bucket now: no capture inside a timed row
            lock = threading.Lock()

            def eager_locked(inp):
                with lock:
                    return model(inp)

            for _ in range(20):
                gm(x), eager_locked(x)
        batcher = Batcher(gm)
        # warm the batcher up: its probe, and the joined buckets
        _threads(batcher, make_input, 16, 0.3)
        _coroutines(batcher, make_input, 64, 0.3)
        for n in clients:
            strategies = {
                "(a) eager behind a lock": lambda: _threads(eager_locked, make_input, n, seconds),
                "(b) threads sharing gm(x)": lambda: _threads(gm, make_input, n, seconds),
                "(c) Batcher, threads": lambda: _threads(batcher, make_input, n, seconds),
                "(d) Batcher, asyncio coroutines": lambda: _coroutines(batcher, make_input, n, seconds),
            }
            for strat, fn in strategies.items():
                before = batcher.stats()
                rps, lat = fn()
                after = batcher.stats()
                calls = after["module_calls"] - before["module_calls"]
                reqs = after["requests"] - before["requests"]
                row = {"model": name, "clients": n, "strategy": strat, "rps": rps,
                       "p50_us": 1e6 * _pct(lat, 0.5), "p99_us": 1e6 * _pct(lat, 0.99),
                       "requests_per_call": reqs / calls if calls else None}
                rows.append(row)
                results.note("serving", f"{name}, {n} clients", strat, rps, "req/s", p50_us=row["p50_us"],
                             p99_us=row["p99_us"], requests_per_call=row["requests_per_call"])
                rpc = f"{row['requests_per_call']:.1f}" if row["requests_per_call"] else "-"
                print(f"  [{name}] {n:4d} clients  {strat:32s} {rps:10.0f} req/s  p50 {row['p50_us']:9.1f} us  "
                      f"p99 {row['p99_us']:10.1f} us  requests/call {rpc}", flush=True)
        batcher.close()
        gm = batcher = None  # let go of this round's models and data before the next
        torch.cuda.empty_cache()
    _chart(results, rows)


def _chart(results, rows):
    if not results.out_dir or not rows:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    import os

    os.makedirs(results.out_dir, exist_ok=True)
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        for strat in dict.fromkeys(r["strategy"] for r in rows):
            pts = [(r["clients"], r["rps"]) for r in rows if r["model"] == m and r["strategy"] == strat]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=strat)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("closed-loop clients (batch-1 requests)")
        ax.set_ylabel("requests/s")
        ax.set_title(m, fontsize=9)
        ax.legend(fontsize=7)
    env = results.env
    fig.suptitle(f"serving: {env['device']}, torch {env['torch']}, {env['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(results.out_dir, "serving.png"), dpi=110)
    plt.close(fig)
