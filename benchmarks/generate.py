"""Scenario "generate": many generations at once through ``gm.generate`` (continuous batching).

GPT-2 124M and a Llama-shaped 1.1B model (random weights, fp16, greedy, no end-of-sequence
token). The burst: 64 requests at once, prompt lengths 16..128 and new tokens 32..256 drawn from
a fixed seed. Rows, each in this process: 64 threads calling ``gm.generate`` (default settings;
its first pass, which captures, timed apart), the same with ``compile=True``, one
``gm.generate`` after another (the first 8 requests), the 64 prompts left-padded into one call
by hand (every row to the longest), transformers' ``generate_batch`` (each request makes the
longest's count: all counted), and the step's own graph at 64 rows replayed bare. The closed
loop: 64 clients, each sending its next request when its last ends, for a fixed time, after a
first 3-second closed loop reported apart (it captures the prompt shapes that only requests
arriving one or two at a time make, and each capture stalls every row). Tokens/s
count the new tokens asked for; time to first token and per output token come from a streamer
on each request. 8 requests' tokens are compared with ``model.generate`` alone.
"""

import contextlib
import statistics
import threading
import time

import torch

from graphwrap import GraphedModule

REQUESTS, CLIENTS = 64, 64


class Clock:
    """A streamer that notes when each token came."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def workload(vocab: int, n: int = REQUESTS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(16, 129, (n,), generator=g).tolist()
    news = torch.randint(32, 257, (n,), generator=g).tolist()
    return [(torch.randint(3, vocab, (1, p), generator=g), k) for p, k in zip(lens, news)]


def renewed(reqs, seed: int, vocab: int):
    """The requests' prompt lengths and new tokens, with prompts of new ids: graphwrap caches
    prompts' prefixes, so a prompt sent again would be served from the cache, where
    ``model.generate`` and the peers compute it again (each warm run here sends prompts of its own)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, vocab, tuple(p.shape), generator=g), k) for p, k in reqs]


def _model(name, device):
    from decode import _model as make

    model = make(name, device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def burst(gm, reqs, device, stream=False):
    """Every request from its own thread at once; (seconds, per-request done times, clocks, outputs).
    With ``stream``, each request has a streamer (a :class:`Clock`)."""
    outs, done = [None] * len(reqs), [0.0] * len(reqs)
    clocks = [Clock() if stream else None for _ in reqs]
    ids = [p.to(device) for p, _ in reqs]
    start = threading.Barrier(len(reqs) + 1)

    def one(i):
        start.wait()
        kw = {"streamer": clocks[i]} if clocks[i] is not None else {}
        outs[i] = gm.generate(input_ids=ids[i], max_new_tokens=reqs[i][1], do_sample=False, **kw)
        done[i] = time.perf_counter()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, [d - t0 for d in done], clocks, outs


def fresh_latencies(gm):
    """Empty the decode batch's latency records, so that its stats() cover what follows."""
    server = gm.__dict__.get("_gw_decode")
    if server is not None:
        server.ttft.clear()
        server.tpot.clear()


def server_latencies(gm) -> dict:
    d = gm.stats()["decode"]
    return {"ttft_p50_ms": d["ttft_ms"]["p50"], "ttft_p99_ms": d["ttft_ms"]["p99"], "tpot_p50_ms": d["tpot_ms"]["p50"],
            "tpot_p99_ms": d["tpot_ms"]["p99"]}


def latencies(clocks, t0=None):
    ttft = [c.times[1] - c.times[0] for c in clocks if len(c.times) > 1]
    tpot = [(c.times[-1] - c.times[1]) / (len(c.times) - 2) for c in clocks if len(c.times) > 2]
    return ttft, tpot


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _sender(reqs, vocab: int, device, c: int):
    """A client's requests in turn, each prompt of new ids (``renewed``), on ``device``."""
    g = torch.Generator().manual_seed(1_000 + c)

    def send(i):
        p, k = reqs[i % len(reqs)]
        return torch.randint(3, vocab, tuple(p.shape), generator=g).to(device), k
    return send


def closed_loop(gm, reqs, device, seconds, vocab: int):
    """64 client threads, each sending its next request (a prompt of its own) when its last ends."""
    stop = time.perf_counter() + seconds
    made, clocks, lock = [0], [], threading.Lock()

    def client(c):
        i, send = c, _sender(reqs, vocab, device, c)
        while time.perf_counter() < stop:
            ids, k = send(i)
            gm.generate(input_ids=ids, max_new_tokens=k, do_sample=False)
            with lock:
                made[0] += k
            i += CLIENTS
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return made[0] / (time.perf_counter() - t0), clocks


def closed_loop_async(gm, reqs, device, seconds, vocab: int):
    """The same closed loop from 64 asyncio coroutines in one event loop (``await gm.agenerate``)."""
    import asyncio

    async def main():
        stop = time.perf_counter() + seconds
        made = [0]

        async def client(c):
            i, send = c, _sender(reqs, vocab, device, c)
            while time.perf_counter() < stop:
                ids, k = send(i)
                await gm.agenerate(input_ids=ids, max_new_tokens=k, do_sample=False)
                made[0] += k
                i += CLIENTS

        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(CLIENTS)))
        return made[0] / (time.perf_counter() - t0)

    return asyncio.run(main())


def step_graph(gm, rows: int, span: int, fold: bool = True, step=None):
    """ms per bare replay of the decode step captured by hand at ``rows`` rows over ``span``
    (``fold``: with the batch's grouped-query attention, as its steps run; else transformers'
    own sdpa; ``step``: the forward to capture, the batch's plain step by default)."""
    server = gm.__dict__["_gw_decode"]
    with server.fold if fold else contextlib.nullcontext():
        return _step_graph(server, rows, span, step)


def _step_graph(server, rows: int, span: int, step=None):
    step, store = step or server.engine.module, server.store
    ids = torch.zeros((rows, 1), dtype=torch.long, device=server.device)
    window = store.window(span)
    saved = store.lengths.clone(), store.live.clone()
    store.lengths[:rows] = span // 2
    store.live[:rows] = 0
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(3):
            step(ids, window)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        step(ids, window)
    ts = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            g.replay()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) / 50)
    store.lengths.copy_(saved[0])
    store.live.copy_(saved[1])
    del g
    return ts


def check_tokens(model, gm, reqs, device, k=8):
    """Rows equal to model.generate alone; where one differs, eager's two best logits' gap there."""
    equal, gaps = 0, []
    for p, n in reqs[:k]:
        ids = p.to(device)
        with torch.no_grad():
            ref = model.generate(input_ids=ids, max_new_tokens=n, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        got = gm.generate(input_ids=ids, max_new_tokens=n, do_sample=False)
        a, b = got[0, ids.shape[1]:], ref.sequences[0, ids.shape[1]:]
        if torch.equal(a, b):
            equal += 1
            continue
        at = int((a != b).nonzero()[0])
        top = ref.logits[at][0].float().topk(2).values
        gaps.append(float(top[0] - top[1]) / (torch.finfo(torch.float16).eps * max(float(top[0].abs()), 1e-4)))
    return equal, gaps


def _report(results, case, name, seconds, tokens, lat=None, extra=""):
    tps = tokens / seconds
    line = f"  [{case}] {name}: {tps:,.0f} tokens/s ({seconds:.3f} s)"
    kw = {"tokens_per_s": tps}
    if lat:
        kw.update(lat)
        line += (f", time to first token p50 {kw['ttft_p50_ms']:.1f} / p99 {kw['ttft_p99_ms']:.1f} ms, per output "
                 f"token p50 {kw['tpot_p50_ms']:.2f} / p99 {kw['tpot_p99_ms']:.2f} ms")
    print(line + extra, flush=True)
    results.add("generate", case, name, [seconds], "s", None, None, **kw)
    return tps


def run(results, device, quick: bool, repeats: int, models=("gpt2", "llama"), seconds: float = 10.0,
        peers: bool = True, compiled: bool = True):
    for name in models:
        model = _model(name, device)
        reqs = workload(model.config.vocab_size)
        tokens = sum(k for _, k in reqs)
        case = f"{name} fp16, {len(reqs)} requests at once, {tokens} new tokens"
        print(f"  [{case}] prompts 16..128 (median {statistics.median(p.shape[1] for p, _ in reqs):.0f}), new "
              f"32..256 (median {statistics.median(k for _, k in reqs):.0f})", flush=True)
        gm = GraphedModule(model)
        cold, *_ = burst(gm, reqs, device)
        print(f"  [{case}] first burst (captures the step's graphs): {cold:.2f} s", flush=True)
        vocab = model.config.vocab_size
        for r in range(1 if quick else 3):
            fresh_latencies(gm)
            t, done, _, _ = burst(gm, renewed(reqs, 1 + r, vocab), device)
            _report(results, case, "gm.generate from 64 threads (default settings)", t, tokens, server_latencies(gm),
                    f", median request done after {statistics.median(done):.2f} s")
        t, _, clocks, _ = burst(gm, renewed(reqs, 10, vocab), device, stream=True)
        ttft, tpot = latencies(clocks)
        _report(results, case, "the same, each request with a streamer", t, tokens, {
            "ttft_p50_ms": 1e3 * pct(ttft, .5), "ttft_p99_ms": 1e3 * pct(ttft, .99),
            "tpot_p50_ms": 1e3 * pct(tpot, .5), "tpot_p99_ms": 1e3 * pct(tpot, .99)})
        _stats(case, gm)
        span = 3.0 if quick else seconds
        fresh_latencies(gm)
        rate, _ = closed_loop(gm, reqs, device, 3.0, vocab)  # captures the shapes of prompts that come one or two at a time
        _report(results, case, f"first closed loop, {CLIENTS} client threads, 3 s (captures new prompt shapes)", 1.0,
                rate, server_latencies(gm))
        fresh_latencies(gm)
        rate, _ = closed_loop(gm, reqs, device, span, vocab)
        _report(results, case, f"closed loop, {CLIENTS} client threads, {span:.0f} s", 1.0, rate, server_latencies(gm))
        fresh_latencies(gm)
        rate = closed_loop_async(gm, reqs, device, span, vocab)
        _report(results, case, f"closed loop, {CLIENTS} asyncio clients (agenerate), {span:.0f} s", 1.0, rate,
                server_latencies(gm))
        _stats(case, gm)
        _alone(results, case, gm, reqs, device)
        _padded(results, case, gm, reqs, device, tokens)
        ts = step_graph(gm, 64, 384)
        print(f"  [{case}] the step's own graph, 64 rows over 384 positions, bare replay: "
              f"{1e3 * statistics.median(ts):.3f} ms (min {1e3 * min(ts):.3f}, max {1e3 * max(ts):.3f})", flush=True)
        results.add("generate", case, "the step's graph at 64 rows, bare replay", ts, "ms", None, None)
        if gm.__dict__["_gw_decode"].fold.config is not None:
            ts = step_graph(gm, 64, 384, fold=False)
            print(f"  [{case}] the same with transformers' sdpa (keys repeated per query head): "
                  f"{1e3 * statistics.median(ts):.3f} ms (min {1e3 * min(ts):.3f}, max {1e3 * max(ts):.3f})",
                  flush=True)
            results.add("generate", case, "the step's graph at 64 rows, transformers' sdpa, bare replay", ts, "ms",
                        None, None)
        equal, gaps = check_tokens(model, gm, reqs, device)
        print(f"  [{case}] tokens against model.generate alone: {equal} of 8 requests equal"
              + (f"; where one differs, eager's two best logits were {', '.join(f'{g:.1f}' for g in gaps)} fp16 ulps "
                 "apart" if gaps else ""), flush=True)
        gm.close()
        if peers:
            torch.cuda.empty_cache()  # the peer sizes its paged cache from the memory free now
            _generate_batch(results, case, model, reqs)
        if compiled and not quick:
            gmc = GraphedModule(model, compile=True)
            cold, *_ = burst(gmc, reqs, device)
            fresh_latencies(gmc)
            t, done, _, _ = burst(gmc, renewed(reqs, 11, vocab), device)
            _report(results, case, "gm.generate from 64 threads, compile=True", t, tokens, server_latencies(gmc),
                    f" (first burst {cold:.1f} s)")
            gmc.close()
        del gm, model
        torch.cuda.empty_cache()


def _stats(case, gm):
    st = gm.stats()["decode"]
    step = st["step"]
    pre = st["prefill"]
    capture = sum(b["capture_s"] + b["verify_s"] for e in (step, pre) for k in e["keys"] for b in k["buckets"].values())
    print(f"  [{case}] decode stats: {st['steps']} steps, {st['rows_per_step']:.1f} rows a step "
          f"({st['padded_rows_per_step']:.1f} padding), served by a larger graph {st['in_a_larger_graph']}, "
          f"{st['prefills']} prefills of {st['rows_per_prefill']:.1f} rows, cache {st['cache_bytes'] / 2**20:.0f} MiB, "
          f"graphs {st['shapes']}, their capture and checks {capture:.1f} s, pools "
          f"{(step['graph_pool_bytes'] + pre['graph_pool_bytes']) / 2**20:.0f} MiB, eager calls "
          f"{step['eager_calls']} {pre['eager_calls']}, decode thread {st['thread_s']}", flush=True)


def _alone(results, case, gm, reqs, device):
    """One request at a time: the first 8, and ms a token at one row (32-token prompt, 128 new)."""
    t0 = time.perf_counter()
    n = 0
    for p, k in reqs[:8]:
        gm.generate(input_ids=p.to(device), max_new_tokens=k, do_sample=False)
        n += k
    _report(results, case, "one gm.generate after another (8 requests)", time.perf_counter() - t0, n)
    ids = reqs[0][0][:, :32].to(device).contiguous() if reqs[0][0].shape[1] >= 32 else reqs[0][0].to(device)
    per = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gm.generate(input_ids=ids, max_new_tokens=128, do_sample=False)
        t1 = time.perf_counter()
        gm.generate(input_ids=ids, max_new_tokens=1, do_sample=False)
        t2 = time.perf_counter()
        per.append(((t1 - t0) - (t2 - t1)) / 127)
    print(f"  [{case}] one request alone, 128 new tokens: {1e3 * statistics.median(per):.3f} ms a token "
          f"(min {1e3 * min(per):.3f}, max {1e3 * max(per):.3f})", flush=True)
    results.add("generate", case, "one request alone: per token", per, "ms", None, None)


def _padded(results, case, gm, reqs, device, tokens):
    """The 64 prompts left-padded into one call by hand, every row to the longest."""
    width, longest = max(p.shape[1] for p, _ in reqs), max(k for _, k in reqs)
    ids = torch.zeros((len(reqs), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(reqs):
        ids[i, width - p.shape[1]:] = p[0]
        mask[i, width - p.shape[1]:] = 1
    ids, mask = ids.to(device), mask.to(device)
    gm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, do_sample=False)
    ts = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, do_sample=False)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    t = statistics.median(ts)
    _report(results, case, f"the 64 prompts left-padded into one gm.generate ({longest} steps)", t, tokens,
            extra=f", {1e3 * t / longest:.2f} ms a step")


def _generate_batch(results, case, model, reqs):
    from transformers import GenerationConfig

    longest = max(k for _, k in reqs)
    cfg = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        with torch.no_grad():
            model.generate_batch(inputs=[p[0].tolist() for p, _ in reqs[:4]], generation_config=cfg,
                                 progress_bar=False)
            t0 = time.perf_counter()
            out = model.generate_batch(inputs=[p[0].tolist() for p, _ in reqs], generation_config=cfg,
                                       progress_bar=False)
            t = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported
        print(f"  [{case}] transformers generate_batch: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        return
    made = sum(len(getattr(v, "generated_tokens", []) or []) for v in out.values()) if isinstance(out, dict) else 0
    _report(results, case, "transformers generate_batch (every request to the longest; all counted)", t,
            made or len(reqs) * longest)
