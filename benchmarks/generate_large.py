"""Scenario "generate-large": the shared batch on the model shapes people serve.

Llama-2-7B (32 key heads, 4,096 positions), Llama-3-8B (8 key heads, 8,192 positions) and
Mistral-7B (8 key heads, a sliding window of 4,096 over 32,768 positions) shapes, and
Gemma-2-9B's (``--models gemma2-9b``: 42 layers, a window of 4,096 on every other one, scores
and logits capped), fp16, random weights made on the GPU (built on the meta device, then filled). The
burst: 64 requests at once, prompts 16..1,024 and new tokens 32..512 from a fixed seed, no
end-of-sequence token, greedy. Rows, each in this process: ``model.generate`` one request after
another (the first 2 requests, 64 new tokens each; the median of 3 passes after 2 untimed), ``gm.generate`` from 64 threads with default
settings (its first burst, which captures, timed apart), and one prompt of 6,000 tokens (on a
model of 8,192 positions) sent while 32 other requests decode, with those rows' time per output
token. The cache's layout, its blocks and its budget are printed; 4 requests' tokens are
compared with ``model.generate`` alone over their first 48 tokens (where one differs, eager's two
best logits' gap there).

The roofline share of a step: the bytes a 64-row step must read (the weights, and the live
rows' keys and values) over the GPU's memory bandwidth, against the step's time (the decode
thread's steps per second while all 64 rows are busy, from its time per output token p50).
"""

import statistics
import time

import torch
from generate import burst, check_tokens, fresh_latencies, latencies, pct, renewed, server_latencies

from graphwrap import GraphedModule

REQUESTS = 64
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}

SHAPES = {
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    # Mistral-7B's config defaults: a sliding window of 4,096 over 32,768 positions
    "mistral-7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, sliding_window=4096),
    # Gemma-2-9B: layers with a sliding window of 4,096 beside full ones, scores and logits capped
    "gemma2-9b": dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
                      sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      query_pre_attn_scalar=256),
}


def big_model(name: str, device):
    """A model of the shape ``name``, random weights, fp16, made on ``device`` in seconds."""
    import transformers

    kind = name.split("-")[0].rstrip("0123456789")
    config, family = {"mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
                      "gemma": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM)}.get(
        kind, (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    cfg = config(**SHAPES[name], pad_token_id=0, bos_token_id=1, eos_token_id=None)
    with torch.device("meta"):
        model = family(cfg)
    model = model.to_empty(device=device).half().eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:  # (Gemma's norms scale by 1 + weight)
                p.fill_(0.0 if kind == "gemma" else 1.0)
            else:
                p.normal_(0.0, 0.02)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg).to(device)  # (its tables were on meta)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def workload(vocab: int, n: int = REQUESTS, seed: int = 0, prompts=(16, 1025), news=(32, 513)):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(*prompts, (n,), generator=g).tolist()
    ks = torch.randint(*news, (n,), generator=g).tolist()
    return [(torch.randint(3, vocab, (1, p), generator=g), k) for p, k in zip(lens, ks)]


def _say(case, text):
    print(f"  [{case}] {text}", flush=True)


def _bandwidth() -> float:
    name = torch.cuda.get_device_name()
    return next((v for k, v in BANDWIDTH.items() if k in name), 3.35e12)


def run(results, device, quick: bool, repeats: int, models=("llama2-7b", "llama3-8b"), long_prompt: bool = True,
        paged=None):
    for name in models:
        model = big_model(name, device)
        reqs = workload(model.config.vocab_size)
        tokens = sum(k for _, k in reqs)
        case = f"{name} shape fp16, {len(reqs)} requests at once, {tokens} new tokens"
        _say(case, f"prompts 16..1024 (median {statistics.median(p.shape[1] for p, _ in reqs):.0f}), new 32..512 "
                   f"(median {statistics.median(k for _, k in reqs):.0f}); weights "
                   f"{sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9:.1f} GB")
        base = _alone_rate(model, reqs, device)
        results.add("generate-large", case, "model.generate, one request after another", [1 / base], "s/token",
                    None, None, tokens_per_s=base)
        _say(case, f"model.generate one request after another (2 requests, 64 new each): {base:.1f} tokens/s")
        gm = GraphedModule(model, decode={"paged": paged})
        cold, *_ = burst(gm, reqs, device)
        _say(case, f"first burst (captures the step's graphs): {cold:.2f} s, {tokens / cold:,.0f} tokens/s")
        _cache(case, gm)
        rates = []
        for r in range(1 if quick else 2):
            fresh_latencies(gm)
            t, done, _, _ = burst(gm, renewed(reqs, 1 + r, model.config.vocab_size), device)
            rates.append(tokens / t)
            lat = server_latencies(gm)
            results.add("generate-large", case, "gm.generate from 64 threads (default settings)", [t], "s", None,
                        None, tokens_per_s=tokens / t, **lat)
            _say(case, f"gm.generate from 64 threads: {tokens / t:,.0f} tokens/s ({t:.2f} s, "
                       f"{tokens / t / base:.0f}x model.generate one after another), time to first token p50 "
                       f"{lat['ttft_p50_ms']:.0f} / p99 {lat['ttft_p99_ms']:.0f} ms, per output token p50 "
                       f"{lat['tpot_p50_ms']:.2f} / p99 {lat['tpot_p99_ms']:.2f} ms")
        _roofline(case, gm, model, reqs, results)
        if long_prompt and model.config.max_position_embeddings >= 8192:
            _long(case, gm, model, device, results)
        equal, gaps = check_tokens(model, gm, [(p, min(k, 48)) for p, k in reqs[:4]], device, k=4)
        _say(case, f"tokens against model.generate alone: {equal} of 4 requests equal"
             + (f"; where one differs, eager's two best logits were {', '.join(f'{g:.1f}' for g in gaps)} fp16 ulps "
                "apart" if gaps else ""))
        _cache(case, gm)
        gm.close()
        del gm, model
        torch.cuda.empty_cache()


def _alone_rate(model, reqs, device) -> float:
    """tokens/s of ``model.generate`` over the first 2 requests one after another (64 new tokens
    each), the median of 3 passes after 2 untimed ones: a 7-8B model's first calls run at a
    quarter of its pace (on an H200: 13 and 10 tokens/s, then 44 and 36;
    the generate_alone.py probe, in the history)."""
    rates = []
    with torch.no_grad():
        for i in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for p, _ in reqs[:2]:
                model.generate(input_ids=p.to(device), max_new_tokens=64, do_sample=False)
            torch.cuda.synchronize()
            if i >= 2:
                rates.append(128 / (time.perf_counter() - t0))
    _say("model.generate", f"passes over the 2 requests: {', '.join(f'{r:.1f}' for r in rates)} tokens/s")
    return statistics.median(rates)


def _cache(case, gm):
    d = gm.stats()["decode"]
    _say(case, f"cache: {d['cache']}, {d['cache_bytes'] / 1e9:.1f} GB of a {d['cache_budget_bytes'] / 1e9:.1f} GB "
               f"budget, blocks {d['cache_blocks']}, max_len {d['max_len']}, {d['steps']} steps of "
               f"{d['rows_per_step']:.1f} rows, {d['prefills']} prefills, {d['prefill_pieces']} prompt pieces, "
               f"GPU memory peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB")


def _roofline(case, gm, model, reqs, results):
    """Bytes a 64-row step reads at the burst's median live length, over the bandwidth, against
    the time per output token p50 of the last burst."""
    d = gm.stats()["decode"]
    tpot = d["tpot_ms"]["p50"] / 1e3
    server = gm.__dict__["_gw_decode"]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    live = statistics.median(p.shape[1] + k / 2 for p, k in reqs)  # a row's positions, midway through
    kv = REQUESTS * live * server.cache.token_bytes
    floor = (weights + kv) / _bandwidth()
    share = floor / tpot
    results.add("generate-large", case, "roofline share of a 64-row step", [tpot], "s", None, None,
                floor_ms=1e3 * floor, share=share)
    _say(case, f"step: {weights / 1e9:.1f} GB of weights + {kv / 1e9:.1f} GB of keys and values "
               f"({REQUESTS} rows x {live:.0f} positions) = {1e3 * floor:.2f} ms at {_bandwidth() / 1e12:.2f} TB/s; "
               f"time per output token p50 {1e3 * tpot:.2f} ms: {share:.0%} of the roofline")


def parted(model, prompt, ours, ref):
    """Where ``ours`` first parts from ``ref`` (their new tokens), and eager's logits there: the
    margin of ``ref``'s token over ours (a near tie where it is within fp16's rounding)."""
    n = prompt.shape[1]
    diff = (ours[0, n:] != ref[0, n:]).nonzero()
    if not len(diff):
        return "equal"
    i = int(diff[0])
    with torch.no_grad():
        logits = model(input_ids=ref[:, :n + i]).logits[0, -1].float()
    a, b = int(ref[0, n + i]), int(ours[0, n + i])
    top2 = logits.topk(2).values
    return (f"part at new token {i}: eager's logit of model.generate's token {logits[a]:.4f}, of ours "
            f"{logits[b]:.4f} (margin {logits[a] - logits[b]:.4f}; eager's top two {top2[0]:.4f}, {top2[1]:.4f})")


def _long(case, gm, model, device, results, seed: int = 0):
    """A 6,000-token prompt sent while 32 requests decode: served, and the others' time per token.
    Each ``seed`` gives prompts of their own (a prompt sent again is served from the prefix cache)."""
    from generate import Clock

    g = torch.Generator().manual_seed(7 + seed)
    long_ids = torch.randint(3, model.config.vocab_size, (1, 6000), generator=g).to(device)
    others = workload(model.config.vocab_size, n=32, seed=3 + 1000 * seed, prompts=(16, 129), news=(200, 201))
    clocks = [Clock() for _ in others]
    import threading

    outs = [None] * len(others)

    def one(i):
        outs[i] = gm.generate(input_ids=others[i][0].to(device), max_new_tokens=others[i][1], do_sample=False,
                              streamer=clocks[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(others))]
    server = gm.__dict__["_gw_decode"]
    spent, shapes = dict(server.spent), set(server.shapes.ready)
    collections = []  # (start, seconds, generation) of Python's garbage collections meanwhile
    started = {}

    def collected(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            collections.append((started["t"], time.perf_counter() - started.pop("t"), info["generation"]))

    import gc

    gc.callbacks.append(collected)
    for t in threads:
        t.start()
    time.sleep(0.5)  # the others are decoding
    t0 = time.perf_counter()
    out = gm.generate(input_ids=long_ids, max_new_tokens=16, do_sample=False)
    took = time.perf_counter() - t0
    for t in threads:
        t.join()
    gc.callbacks.remove(collected)
    slow = [(round(1e3 * (a - t0), 1), round(1e3 * d, 2), g) for a, d, g in collections if d > 1e-3]
    _say(case, f"  Python's garbage collections meanwhile: {len(collections)}, of them over 1 ms (ms after the "
               f"prompt was sent, ms, generation): {slow[:8]}")
    gaps = [b - a for c in clocks for a, b in zip(c.times[1:], c.times[2:])]
    during = [b - a for c in clocks for a, b in zip(c.times[1:], c.times[2:]) if t0 <= a and b <= t0 + took]
    apart = [b - a for c in clocks for a, b in zip(c.times[1:], c.times[2:]) if b < t0 or a > t0 + took]
    thread = {k: round(v - spent.get(k, 0.0), 3) for k, v in server.spent.items()}
    _say(case, f"  the decode thread meanwhile (s): {thread}; the 5 longest gaps (ms): "
               f"{[round(1e3 * g, 1) for g in sorted(gaps)[-5:]]}; shapes captured meanwhile: "
               f"{sorted(server.shapes.ready - shapes)}")
    edges = (10, 15, 20, 25, 30, 50, float("inf"))
    bins = [sum(1 for g in gaps if lo <= 1e3 * g < hi) for lo, hi in zip((0,) + edges, edges)]
    _say(case, "  the others' gaps by ms: " + ", ".join(f"<{hi}: {n}" for hi, n in zip(edges, bins)))
    _say(case, f"  the decode thread's slowest turns since the batch was made: {server.turns.slowest()[:4]}")
    if during:
        _say(case, f"  the others' gaps while the long prompt was served ({len(during)}): p50 "
                   f"{1e3 * pct(during, .5):.2f} / p99 {1e3 * pct(during, .99):.2f} / longest {1e3 * max(during):.2f} ms")
        when = sorted({(round(1e3 * (b - a), 1), round(1e3 * (a - t0), 1)) for c in clocks
                       for a, b in zip(c.times[1:], c.times[2:]) if t0 <= a and b <= t0 + took}, reverse=True)[:5]
        _say(case, f"  its longest gaps (ms, and when each began: ms after the prompt was sent, of {1e3 * took:.0f}): {when}")
    if apart:
        _say(case, f"  the others' gaps before and after it ({len(apart)}): p50 "
                   f"{1e3 * pct(apart, .5):.2f} / p99 {1e3 * pct(apart, .99):.2f} / longest {1e3 * max(apart):.2f} ms")
    with torch.no_grad():
        ref = model.generate(input_ids=long_ids, max_new_tokens=16, do_sample=False)
    same = torch.equal(out, ref)
    if not same:
        _say(case, f"  tokens: {parted(model, long_ids, out, ref)}")
    _, tpot = latencies(clocks)
    p50, p99 = pct(gaps, .5), pct(gaps, .99)
    results.add("generate-large", case, "a 6,000-token prompt beside 32 decoding rows", [took], "s", None, None,
                gap_p50_ms=1e3 * p50, gap_p99_ms=1e3 * p99, equal=same,
                during_p99_ms=1e3 * pct(during, .99) if during else None,
                apart_p50_ms=1e3 * pct(apart, .5) if apart else None)
    _say(case, f"a 6,000-token prompt beside 32 decoding requests: served in {took:.2f} s, 16 tokens "
               f"{'equal to' if same else 'NOT equal to'} model.generate's; the others' gaps between tokens p50 "
               f"{1e3 * p50:.2f} / p99 {1e3 * p99:.2f} ms (p99/p50 {p99 / p50:.2f})")


if __name__ == "__main__":
    import argparse

    from harness import Results

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama2-7b,llama3-8b", help="one process each is cleaner: run it per model")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--paged", choices=["auto", "yes", "no"], default="auto", help="the cache's layout (auto: default)")
    a = ap.parse_args()
    res = Results(a.out)
    env = res.env
    print(f"generate-large: {env['device']}, torch {env['torch']}, {env['date']}", flush=True)
    run(res, torch.device("cuda"), a.quick, 1, models=tuple(a.models.split(",")),
        paged={"auto": None, "yes": True, "no": False}[a.paged])
    res.write(["generate-large"])
