"""Scenario "decode": greedy decoding with a static KV cache, ms per token and end to end.

GPT-2 (124M, its base config) and a Llama-shaped 1.1B model (22 layers, 2048 wide, 32 query and
4 key-value heads), and with ``--decode-models mistral`` the same shape as Mistral with a 64-token
sliding window (it passes within the 160 positions decoded), random weights, fp16, a 32-token prompt, 128 new tokens, batch 1 and 8.
Strategies, each in this process: transformers' eager loop with its StaticCache
(``generate(cache_implementation="static", disable_compile=True)``); ``gm.generate`` with default
settings; the decode step captured by hand in one CUDA graph (argmax outside); and, without
--quick, ``generate`` as transformers compiles it (``cache_implementation="static"``, its
automatic compile), ``gm.generate`` with ``compile=True``, and the step captured by hand over
Inductor's kernels (``torch.compile`` without its CUDA graphs). Per token = (time for 128 tokens - time for 1) / 127; each row's
tokens are compared with the eager loop's.
"""

import time

import torch

from graphwrap import GraphedModule

PROMPT, NEW = 32, 128


def _timed(fn, rounds):
    ts = []
    out = None
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts), out


def _by_hand(model, ids, new, compiled=False):
    """Prefill eagerly, then each step one replay of a graph captured by hand; argmax outside.
    ``compiled``: the step's kernels are Inductor's (``torch.compile`` without its CUDA graphs)."""
    import transformers

    device, (b, p) = ids.device, ids.shape
    cache = transformers.StaticCache(config=model.config, max_cache_len=p + new)
    static_ids = torch.zeros(b, 1, dtype=torch.long, device=device)
    forward = torch.compile(model.forward, dynamic=False) if compiled else model.forward

    def prefill():
        cache.reset()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        static_ids.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
        return static_ids.clone()

    def step():
        return forward(input_ids=static_ids, past_key_values=cache, use_cache=True).logits

    with torch.no_grad():
        prefill()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        prefill()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            logits = step()

    def run(n=new):
        with torch.no_grad():
            toks = [prefill()]
            for _ in range(n - 1):
                g.replay()
                static_ids.copy_(logits[:, -1].argmax(-1, keepdim=True))
                toks.append(static_ids.clone())
            return torch.cat([ids] + toks, dim=1)
    return run


MODELS = {
    "gpt2": "GPT-2 124M",
    "llama": "Llama-shaped 1.1B (22 layers, 2048 wide, 32/4 heads)",
    "mistral": "Mistral-shaped 1.1B (the Llama shape, a 64-token sliding window)",
}


def _model(name, device):
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config()
        cfg.pad_token_id = cfg.eos_token_id
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        shape = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                     num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, pad_token_id=0)
        if name == "mistral":  # its window passes within the 160 positions decoded
            model = transformers.MistralForCausalLM(transformers.MistralConfig(**shape, sliding_window=64))
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    return model.to(device).half().eval()


def _first_differences(out, want, logits):
    """Rows whose tokens differ from eager's, and at each one's first difference, how far apart
    eager's two best logits were, in fp16 units in the last place of the best (random weights make
    near ties, which kernels that round differently break the other way)."""
    if out.shape != want.shape:
        return out.shape[0], [float("inf")]
    ties = []
    for r in range(out.shape[0]):
        diff = (out[r, PROMPT:] != want[r, PROMPT:]).nonzero()
        if diff.numel():
            step = int(diff[0])
            top = logits[step][r].float().topk(2).values
            ulp = torch.finfo(torch.float16).eps * max(float(top[0].abs()), 2.0 ** -14)
            ties.append(float(top[0] - top[1]) / ulp)
    return len(ties), ties


def run(results, device, quick: bool, repeats: int, models=("gpt2", "llama")):
    rounds = 3 if quick else 5
    for name in models:
        model = _model(name, device)
        for batch in (1, 8):
            _one(results, model, MODELS[name], batch, device, quick, rounds)
        del model
        torch.cuda.empty_cache()


def _one(results, model, label, batch, device, quick, rounds):
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, model.config.vocab_size, (batch, PROMPT), generator=g).to(device)
    mask = torch.ones_like(ids)
    common = dict(input_ids=ids, attention_mask=mask, do_sample=False)
    strategies = {
        "transformers eager loop, StaticCache": lambda n: model.generate(
            **common, max_new_tokens=n, cache_implementation="static", disable_compile=True),
    }
    gm = GraphedModule(model)
    strategies["gm.generate, default settings"] = lambda n: gm.generate(
        **common, max_new_tokens=n, cache_implementation="static")
    if not getattr(model.config, "sliding_window", None):
        # transformers' window layer keeps its position in a Python int as well: a graph captured
        # by hand replays it frozen (on the H100 a device-side assert that ended the process)
        hand = _by_hand(model, ids, NEW)
        strategies["the step captured by hand (one graph)"] = lambda n: hand(n)
    if not quick:
        strategies["transformers generate, compiled (static cache)"] = lambda n: model.generate(
            **common, max_new_tokens=n, cache_implementation="static")
        gmc = GraphedModule(model, compile=True)
        strategies["gm.generate, compile=True"] = lambda n: gmc.generate(
            **common, max_new_tokens=n, cache_implementation="static")
        if not getattr(model.config, "sliding_window", None):
            hand_c = _by_hand(model, ids, NEW, compiled=True)
            strategies["the step captured by hand, Inductor's kernels inside"] = lambda n: hand_c(n)
    with torch.no_grad():
        ref = model.generate(**common, max_new_tokens=NEW, cache_implementation="static", disable_compile=True,
                             output_logits=True, return_dict_in_generate=True)
    want = ref.sequences
    case = f"{label} fp16, batch {batch}, prompt {PROMPT}, {NEW} new tokens"
    for name, fn in strategies.items():
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                fn(NEW)
            torch.cuda.synchronize()
            cold = time.perf_counter() - t0
            with torch.no_grad():
                fn(1)  # the prompt alone, warm too (gm.generate sizes a cache of its own for it)
            with torch.no_grad():
                full, out = _timed(lambda: fn(NEW), rounds)
                one, _ = _timed(lambda: fn(1), rounds)
        except Exception as e:  # noqa: BLE001 - a strategy that cannot run is reported
            results.add("decode", case, name, [], "ms", None, None, error=f"{type(e).__name__}: {e}"[:200])
            print(f"  [{case}] {name}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        same = float((out[:, PROMPT:] == want[:, PROMPT:]).float().mean()) if out.shape == want.shape else 0.0
        rows, ties = _first_differences(out, want, ref.logits)
        per_token = [(f - o) / (NEW - 1) for f, o in zip(full, one)]
        results.add("decode", case, f"{name}: per token", per_token, "ms", cold, None,
                    same_tokens=same, rows_that_differ=rows, tie_ulps=ties, end_to_end_s=full[len(full) // 2])
        print(f"  [{case}] {name}: {1e3 * sorted(per_token)[len(per_token) // 2]:.3f} ms/token "
              f"(min {1e3 * min(per_token):.3f}, max {1e3 * max(per_token):.3f}), end to end "
              f"{full[len(full) // 2]:.3f} s, first call {cold:.1f} s, tokens equal to eager's: {same:.1%}"
              + (f" ({rows} rows differ; at each first difference eager's two best logits were within "
                 f"{max(ties):.1f} fp16 ulps)" if rows else ""),
              flush=True)
    st = gm.stats()
    keys = st["keys"]
    capture = sum(b["capture_s"] + b["verify_s"] for k in keys for b in k["buckets"].values())
    print(f"  gm: {len(keys)} keys, capture and checks {capture:.2f} s, graph pool "
          f"{st['graph_pool_bytes'] / 2**20:.0f} MiB, eager calls {st['eager_calls']}", flush=True)
