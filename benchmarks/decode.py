"""Scenario "decode": greedy decoding with a static KV cache, ms per token and end to end.

GPT-2 (124M, its base config) and a Llama-shaped 1.1B model (22 layers, 2048 wide, 32 query and
4 key-value heads), and with ``--decode-models mistral`` the same shape as Mistral with a 64-token
sliding window (it passes within the 160 positions decoded), random weights, fp16, a 32-token prompt, 128 new tokens, batch 1 and 8.
With ``--decode-models whisper``, an encoder-decoder: Whisper's base shape (6 + 6 layers, 512
wide, 74M parameters), 30 s of audio features (80 x 3000), the encoder once, 128 new tokens.
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

    return _captured(prefill, step, static_ids, ids, new)


def _captured(prefill, step, static_ids, ids, new):
    """``run(n)``: ``prefill()`` writes the first token into ``static_ids``, the step's input;
    then each of ``n - 1`` steps is one replay of ``step()``, captured after warm-up on a side
    stream, and the argmax of its logits is copied into ``static_ids``."""
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
    "whisper": "Whisper-base-shaped 74M (30 s of audio features)",
}


def _model(name, device):
    import transformers

    torch.manual_seed(0)
    if name == "whisper":
        cfg = transformers.WhisperConfig(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                                         decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
                                         suppress_tokens=[], begin_suppress_tokens=[])
        return transformers.WhisperForConditionalGeneration(cfg).to(device).half().eval()
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


def _by_hand_seq2seq(model, features, new):
    """An encoder-decoder's steps as :func:`_by_hand`'s: the encoder and the first step eagerly
    (the first writes the cross-attention cache), then each step one replay; argmax outside."""
    import transformers

    b = features.shape[0]
    start = torch.full((b, 1), model.config.decoder_start_token_id, dtype=torch.long, device=features.device)
    with torch.no_grad():
        encoded = model.get_encoder()(features)
    cfg = model.config
    cache = transformers.EncoderDecoderCache(transformers.StaticCache(config=cfg, max_cache_len=new + 1),
                                             transformers.StaticCache(config=cfg, max_cache_len=encoded[0].shape[1]))
    static_ids = torch.zeros(b, 1, dtype=torch.long, device=features.device)

    def prefill():
        cache.reset()
        enc = model.get_encoder()(features)
        out = model(encoder_outputs=enc, decoder_input_ids=start, past_key_values=cache, use_cache=True)
        static_ids.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
        return static_ids.clone()

    def step():
        return model(encoder_outputs=encoded, decoder_input_ids=static_ids, past_key_values=cache, use_cache=True).logits

    return _captured(prefill, step, static_ids, start, new)


def _first_differences(out, want, logits):
    """Rows whose tokens differ from eager's, and at each one's first difference, how far apart
    eager's two best logits were, in fp16 units in the last place of the best (random weights make
    near ties, which kernels that round differently break the other way)."""
    if out.shape[0] != want.shape[0] or min(out.shape[1], want.shape[1]) < NEW:
        return out.shape[0], [float("inf")]
    ties = []
    for r in range(out.shape[0]):
        diff = (out[r, -NEW:] != want[r, -NEW:]).nonzero()
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
    seq2seq = model.config.is_encoder_decoder
    if seq2seq:  # 30 s of audio features; min_new_tokens: random weights can end a row early
        features = torch.randn(batch, model.config.num_mel_bins, 3000, generator=g).to(device).half()
        inputs = dict(input_features=features)
    else:
        ids = torch.randint(3, model.config.vocab_size, (batch, PROMPT), generator=g).to(device)
        inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))

    def common(n):
        return dict(inputs, do_sample=False, max_new_tokens=n, **(dict(min_new_tokens=n) if seq2seq else {}))

    strategies = {
        "transformers eager loop, StaticCache": lambda n: model.generate(
            **common(n), cache_implementation="static", disable_compile=True),
    }
    gm = GraphedModule(model)
    strategies["gm.generate, default settings"] = lambda n: gm.generate(**common(n), cache_implementation="static")
    if seq2seq:
        hand = _by_hand_seq2seq(model, features, NEW)
        strategies["the step captured by hand (one graph)"] = lambda n: hand(n)
    elif not getattr(model.config, "sliding_window", None):
        # transformers' window layer keeps its position in a Python int as well: a graph captured
        # by hand replays it frozen (on the H100 a device-side assert that ended the process)
        hand = _by_hand(model, ids, NEW)
        strategies["the step captured by hand (one graph)"] = lambda n: hand(n)
    if not quick:
        strategies["transformers generate, compiled (static cache)"] = lambda n: model.generate(
            **common(n), cache_implementation="static")
        gmc = GraphedModule(model, compile=True)
        strategies["gm.generate, compile=True"] = lambda n: gmc.generate(**common(n), cache_implementation="static")
        if not getattr(model.config, "sliding_window", None) and not seq2seq:
            hand_c = _by_hand(model, ids, NEW, compiled=True)
            strategies["the step captured by hand, Inductor's kernels inside"] = lambda n: hand_c(n)
    with torch.no_grad():
        ref = model.generate(**common(NEW), cache_implementation="static", disable_compile=True,
                             output_logits=True, return_dict_in_generate=True)
    want = ref.sequences
    case = f"{label} fp16, batch {batch}, " + ("" if seq2seq else f"prompt {PROMPT}, ") + f"{NEW} new tokens"
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
        comparable = out.shape[0] == want.shape[0] and min(out.shape[1], want.shape[1]) >= NEW
        same = float((out[:, -NEW:] == want[:, -NEW:]).float().mean()) if comparable else 0.0
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
