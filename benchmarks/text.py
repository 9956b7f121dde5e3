"""Scenario "text": requests of every length, the workload people serve (BERT-base fp16).

300 requests of 1 to 8 rows, lengths drawn lognormal(3.6, 0.6) and clamped to 8..256 (median
about 35), ``attention_mask`` all ones (``masks="padded"``: each request padded by its client to
a multiple of 16 with the mask zero there), inputs on the GPU. Seconds for the 300 requests:
the first pass (lazy captures included, timed as the cold start) and then the median of the
later passes. Beside eager and graphwrap's one line with and without ``seq_dim=1``, the same
requests padded by hand to 32/64/128/256 and served by ``GraphedModule(m)``. Then the capture
of the whole default grid, and 64 clients in a closed loop: eager on one serving thread (the
main one, which ran every request before), threads sharing ``gm`` (seq_dim=1), and the Batcher
from asyncio coroutines (each thread's first call is made before the clock starts). With ``compiled``: the grid captured from one compile
(``compile=True``), and per call at one fixed shape against ``torch.compile(mode="reduce-overhead")``.
"""

import asyncio
import math
import queue
import random
import threading
import time

import torch
from harness import Case

from graphwrap import Batcher, GraphedModule

HAND = (32, 64, 128, 256)


def workload(vocab: int, device, count: int = 300, seed: int = 0, masks: str = "ones"):
    """The requests: dicts of ``input_ids`` and ``attention_mask`` of 1..8 rows each."""
    rng = random.Random(seed)
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(count):
        L = max(8, min(256, int(rng.lognormvariate(3.6, 0.6))))
        n = rng.randint(1, 8)
        real = L
        if masks == "padded":
            L = min(256, 16 * math.ceil(L / 16))
        ids = torch.randint(1, vocab, (n, L), generator=g)
        mask = torch.ones(n, L, dtype=torch.long)
        mask[:, real:] = 0
        out.append({"input_ids": ids.to(device), "attention_mask": mask.to(device)})
    return out


def padded_by_hand(requests):
    """Each request padded to the next of 32/64/128/256, its mask zero past its length."""
    out = []
    for r in requests:
        L = r["input_ids"].shape[1]
        S = next(s for s in HAND if s >= L)
        ids = torch.zeros(r["input_ids"].shape[0], S, dtype=torch.long, device=r["input_ids"].device)
        mask = torch.zeros_like(ids)
        ids[:, :L] = r["input_ids"]
        mask[:, :L] = r["attention_mask"]
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _passes(results, name, model, requests, repeats):
    hand = padded_by_hand(requests)
    case = Case(results, "text", name)

    def loop_of(fn, reqs):
        def loop():
            with torch.no_grad():
                for r in reqs:
                    fn(**r)
        return loop

    case.add("eager", lambda: loop_of(model, requests))
    case.add("graphwrap one line, GraphedModule(m)", lambda: loop_of(GraphedModule(model), requests))
    case.add("graphwrap GraphedModule(m, seq_dim=1)", lambda: loop_of(GraphedModule(model, seq_dim=1), requests))
    case.add("padded by hand to 32/64/128/256, then GraphedModule(m)", lambda: loop_of(GraphedModule(model), hand))
    case.run(repeats)


def _grid(results, model, requests):
    gm = GraphedModule(model, seq_dim=1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    s = gm.capture(**requests[0])
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    graphs = sum(b["graphs"] for b in s["buckets"].values())
    pool = gm.stats()["graph_pool_bytes"]
    results.note("text", "capture() of the default grid", "GraphedModule(m, seq_dim=1)", took, "s",
                 graphs=graphs, pool_mib=pool / 2**20)
    print(f"  capture() of the default grid: {graphs} graphs in {took:.1f} s, graph pool {pool / 2**20:.0f} MiB",
          flush=True)


def _compiled(results, model, device, repeats, n=8, L=128, calls=50):
    """compile=True with seq_dim=1: the whole default grid from one compile, then per call at one
    fixed shape beside torch.compile(mode="reduce-overhead") compiled for that shape."""
    from models import _calls, _hand_graph, _tuned

    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (n, L), device=device)
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    torch._dynamo.reset()
    gmc = GraphedModule(model, seq_dim=1, compile=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    s = gmc.capture(**kwargs)
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    graphs = sum(b["graphs"] for b in s["buckets"].values())
    compiles = gmc.stats()["compile"]["graphs"]
    results.note("text", "capture() of the default grid", "GraphedModule(m, seq_dim=1, compile=True)", took, "s",
                 graphs=graphs, compiles=compiles, pool_mib=gmc.stats()["graph_pool_bytes"] / 2**20)
    print(f"  compile=True, capture() of the default grid: {graphs} graphs from {compiles} compile(s) in {took:.1f} s",
          flush=True)
    case = Case(results, "text", f"BERT-base fp16, fixed shape {n}x{L}, per call", unit="ms", per=calls)
    with torch.no_grad():
        case.add("torch.compile reduce-overhead", lambda: _calls(torch.compile(model, mode="reduce-overhead"),
                                                                 (), kwargs, calls))
        case.add("graphwrap GraphedModule(m, seq_dim=1, compile=True), the grid above",
                 lambda: _tuned(gmc, (), kwargs, calls))
        case.add("graphwrap GraphedModule(m, seq_dim=1)", lambda: _calls(GraphedModule(model, seq_dim=1), (), kwargs,
                                                                        calls))
        case.add("eager", lambda: _calls(model, (), kwargs, calls))
        case.add("bare replay: hand-captured graph of eager", lambda: _hand_graph(model, (), kwargs, calls))
        case.run(repeats)
    b = gmc.stats()["keys"][0]["buckets"]
    hot = [v for v in b.values() if v.get("per_size_us") is not None]
    for v in hot:
        results.note("text", f"BERT-base fp16, fixed shape {n}x{L}, per call", "graphwrap compile=True: hot bucket",
                     v["shared_us"], "us", per_size_us=v["per_size_us"], kept=v["kernels"])
    torch._dynamo.reset()


def _threads(fn, requests, clients, seconds):
    stop = [math.inf]  # set once every thread has made its first call
    lat = [[] for _ in range(clients)]
    go = threading.Barrier(clients + 1)

    def client(i):
        rng = random.Random(i)
        mine = lat[i]
        with torch.no_grad():  # warm-up: each new thread's first call makes its cuBLAS handle
            fn(**requests[rng.randrange(len(requests))])
        go.wait()
        with torch.no_grad():
            while time.perf_counter() < stop[0]:
                r = requests[rng.randrange(len(requests))]
                t0 = time.perf_counter()
                fn(**r)
                mine.append(time.perf_counter() - t0)

    ts = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t_start = time.perf_counter()
    for t in ts:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    stop[0] = t0 + seconds
    _threads.first_calls_s = t0 - t_start
    for t in ts:
        t.join()
    torch.cuda.synchronize()
    return [v for m in lat for v in m], time.perf_counter() - t0


def _eager_one_thread(model, requests, clients, seconds):
    """Client threads hand their requests to the main thread, which runs the model on each in turn
    (it ran every request of the workload before: eager pays a first-call cost per thread and
    shape, which a server's long-lived thread has paid)."""
    q = queue.SimpleQueue()
    stop = time.perf_counter() + seconds
    lat = [[] for _ in range(clients)]

    def client(i):
        rng = random.Random(i)
        done = threading.Event()
        while time.perf_counter() < stop:
            done.clear()
            t0 = time.perf_counter()
            q.put((requests[rng.randrange(len(requests))], done))
            done.wait()
            lat[i].append(time.perf_counter() - t0)
        q.put(None)

    ts = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    left = clients
    with torch.no_grad():
        while left:
            item = q.get()
            if item is None:
                left -= 1
                continue
            model(**item[0])
            torch.cuda.current_stream().synchronize()  # the answer is ready when the client hears
            item[1].set()
    for t in ts:
        t.join()
    return [v for m in lat for v in m], time.perf_counter() - t0


def _coroutines(acall, requests, clients, seconds):
    """``clients`` coroutines awaiting ``acall(**request)`` in a closed loop: latencies, wall."""
    lat = []

    async def client(i, stop):
        rng = random.Random(i)
        while time.perf_counter() < stop:
            r = requests[rng.randrange(len(requests))]
            t0 = time.perf_counter()
            await acall(**r)
            lat.append(time.perf_counter() - t0)

    async def main():
        stop = time.perf_counter() + seconds
        await asyncio.gather(*(client(i, stop) for i in range(clients)))

    t0 = time.perf_counter()
    with torch.no_grad():
        asyncio.run(main())
    torch.cuda.synchronize()
    return lat, time.perf_counter() - t0


def _serving(results, model, requests, seconds, clients=64):
    gm = GraphedModule(model, seq_dim=1, max_batch_size=64)
    gm.capture(**requests[0])
    batcher = Batcher(gm)
    _coroutines(batcher.acall, requests, clients, min(seconds, 2.0))  # its probe and warm buckets
    _threads(gm, requests, clients, min(seconds, 1.0))
    rows = {"eager, one serving thread": lambda: _eager_one_thread(model, requests, clients, seconds),
            "threads sharing gm (seq_dim=1)": lambda: _threads(gm, requests, clients, seconds),
            "Batcher, asyncio coroutines": lambda: _coroutines(batcher.acall, requests, clients, seconds)}
    for name, fn in rows.items():
        before = batcher.stats()
        lat, wall = fn()
        after = batcher.stats()
        calls = after["module_calls"] - before["module_calls"]
        lat.sort()
        p = lambda q: 1e3 * lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
        rps = len(lat) / wall
        results.note("text", f"{clients} clients, closed loop", name, rps, "req/s", p50_ms=p(0.5), p99_ms=p(0.99),
                     requests_per_call=(after["requests"] - before["requests"]) / calls if calls else None)
        first = ""
        if name.startswith("threads"):
            first = f"  (first calls of the {clients} new threads: {_threads.first_calls_s:.2f} s, untimed)"
        print(f"  {clients} clients  {name:34s} {rps:9.0f} req/s  p50 {p(0.5):8.2f} ms  p99 {p(0.99):8.2f} ms{first}",
              flush=True)
    batcher.close()
    s = gm.stats()
    print(f"  padded share of tokens under the Batcher: {s['padded_token_share']:.1%}", flush=True)


def run(results, device, quick: bool, repeats: int, compiled: bool = True, **_):
    import transformers

    cfg = transformers.BertConfig()
    model = transformers.BertModel(cfg).to(device).half().eval()
    count = 100 if quick else 300
    for masks in ("ones",) if quick else ("ones", "padded"):
        requests = workload(cfg.vocab_size, device, count, masks=masks)
        lengths = sorted(r["input_ids"].shape[1] for r in requests)
        print(f"  {count} requests, masks {masks}: lengths {lengths[0]}..{lengths[-1]}, median "
              f"{lengths[len(lengths) // 2]}, {len(set(lengths))} distinct", flush=True)
        _passes(results, f"BERT-base fp16, {count} requests, masks {masks}", model, requests, repeats)
        torch.cuda.empty_cache()
    requests = workload(cfg.vocab_size, device, count)
    _grid(results, model, requests)
    torch.cuda.empty_cache()
    if compiled:
        _compiled(results, model, device, repeats)
    torch.cuda.empty_cache()
    _serving(results, model, requests, 2.0 if quick else 5.0)
