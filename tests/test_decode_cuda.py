"""Decode loops on a GPU: gm.generate against model.generate (greedy and sampled), every decode
step a replay; a gpt-fast style cache in module buffers at a fixed batch, graphed."""

import pytest
import torch
from helpers import assert_same, generate_alone, held_turn, replays, varied_weights
from torch import nn

from graphwrap import GraphedModule

pytestmark = pytest.mark.cuda
DEV = "cuda"
tr = pytest.importorskip("transformers", reason="needs transformers, which no extra installs: pip install transformers")


def _gpt2():
    cfg = tr.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=256, bos_token_id=1,
                        eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return tr.GPT2LMHeadModel(cfg).to(DEV).eval()


def _greedy_request(batch=2, prompt=10, new=12):
    """generate's keywords for greedy decoding of random prompts with graphwrap's static cache."""
    ids = torch.randint(2, 1000, (batch, prompt), device=DEV)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                cache_implementation="static")


def _same_or_tied(got, want, scores, prompt, tol=1e-3):
    """Tokens equal, or where they first differ, eager's two best logits were within ``tol``
    (random weights make near ties, and a graph's kernels may round differently)."""
    if torch.equal(got, want):
        return True
    diff = (got[:, prompt:] != want[:, prompt:]).any(0).nonzero()
    step = int(diff[0])
    top2 = scores[step].float().topk(2, dim=-1).values
    return bool(((top2[:, 0] - top2[:, 1]) < tol).any())


@pytest.mark.parametrize("batch", [1, 4])
def test_generate_gives_the_models_tokens_each_decode_step_a_replay(batch):
    model = _gpt2()
    gm = GraphedModule(model, decode=False)
    for prompt in (12, 20):
        ids = torch.randint(2, 1000, (batch, prompt), device=DEV)
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                  cache_implementation="static")
        with torch.no_grad():
            out = model.generate(**kw, disable_compile=True, output_logits=True, return_dict_in_generate=True)
            got = gm.generate(**kw)
        assert _same_or_tied(got, out.sequences, out.logits, prompt)
    s = gm.stats()
    assert s["eager_calls"] == {} and len(s["keys"]) == 1
    b = s["keys"][0]["buckets"][1]
    print(f"\nbatch {batch}: {b['serves']} (graph {b['graph_us']} us, eager {b['eager_us']} us), "
          f"{replays(gm)} replays, {b['eager_calls']} eager")
    assert b["serves"] == "graph" and replays(gm) >= 2 * 15 - 4


def test_sampled_tokens_are_the_models_under_the_same_seed():
    model = _gpt2()
    gm = GraphedModule(model, decode=False)
    ids = torch.randint(2, 1000, (2, 10), device=DEV)
    kw = dict(input_ids=ids, max_new_tokens=12, do_sample=True, top_k=50, top_p=0.9, temperature=0.7,
              cache_implementation="static")
    with torch.no_grad():  # the first call captures: graphwrap draws no random numbers of its own
        torch.manual_seed(3)
        want = model.generate(**kw, disable_compile=True)
        torch.manual_seed(3)
        got = gm.generate(**kw)
    assert torch.equal(got, want)
    torch.manual_seed(3)
    with torch.no_grad():
        assert torch.equal(gm.generate(**kw), want)


class Decoder(nn.Module):
    """A decode step with its KV cache in buffers of a fixed batch, written at ``input_pos``."""

    def __init__(self, batch=2, length=32, d=64):
        super().__init__()
        self.q, self.kv = nn.Linear(d, d), nn.Linear(d, 2 * d)
        self.register_buffer("k", torch.zeros(batch, length, d))
        self.register_buffer("v", torch.zeros(batch, length, d))

    def forward(self, x, input_pos):
        k, v = self.kv(x).chunk(2, dim=-1)
        self.k.index_copy_(1, input_pos, k)
        self.v.index_copy_(1, input_pos, v)
        scores = (self.q(x) @ self.k.transpose(1, 2)) / 8.0
        mask = torch.arange(self.k.shape[1], device=x.device) <= input_pos[-1]
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ self.v


def test_a_cache_in_module_buffers_of_a_fixed_batch_is_graphed():
    model, ref = Decoder().to(DEV).eval(), Decoder().to(DEV).eval()
    ref.load_state_dict(model.state_dict())
    gm = GraphedModule(model, batch_dim={"input_pos": None}, eager_if_faster=False)
    for p in range(12):
        x, pos = torch.randn(2, 1, 64, device=DEV), torch.tensor([p], device=DEV)
        assert_same(gm(x, pos), ref(x, pos) if not torch.is_grad_enabled() else ref(x, pos).detach())
        assert torch.equal(model.k, ref.k) and torch.equal(model.v, ref.v)
    assert gm.stats()["writes_buffers"] == ["k", "v"] and replays(gm) >= 10


def test_compile_true_puts_compiled_kernels_in_the_decode_graphs():
    """compile= over a static cache: Inductor's kernels captured in the decode graph, the
    model's tokens, and no per-size tuning (its captures and timings would run the step beside
    the calls that write the cache)."""
    model = _gpt2()
    gm = GraphedModule(model, compile=True, decode=False)
    kw = _greedy_request()
    with torch.no_grad():
        out = model.generate(**kw, disable_compile=True, output_logits=True, return_dict_in_generate=True)
        for _ in range(3):  # past the calls that make a bucket worth tuning
            got = gm.generate(**kw)
            assert _same_or_tied(got, out.sequences, out.logits, 10)
    gm.wait()
    (key,) = gm.stats()["keys"]
    (b,) = key["buckets"].values()
    assert b["compiled"] and b["serves"] == "graph" and b["per_size_us"] is None, b
    assert replays(gm) >= 3 * 10
    torch.cuda.synchronize()  # no device-side assert left behind


def test_compile_true_over_a_cache_in_module_buffers_captures_the_plain_forward(gw_log):
    model, ref = Decoder().to(DEV).eval(), Decoder().to(DEV).eval()
    ref.load_state_dict(model.state_dict())
    gm = GraphedModule(model, batch_dim={"input_pos": None}, eager_if_faster=False, compile=True)
    for p in range(20):
        x, pos = torch.randn(2, 1, 64, device=DEV), torch.tensor([p], device=DEV)
        with torch.no_grad():
            got, want = gm(x, pos), ref(x, pos)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), p
        assert torch.allclose(model.k, ref.k, atol=1e-5) and torch.allclose(model.v, ref.v, atol=1e-5)
    gm.wait()
    st = gm.stats()
    buckets = [b for k in st["keys"] for b in k["buckets"].values()]
    assert any(b["serves"] == "graph" for b in buckets) and replays(gm) >= 10, (st["keys"], st["eager_calls"])
    assert all(b["per_size_us"] is None for b in buckets)
    assert any("writes module buffers" in r.getMessage() for r in gw_log.records)


def test_rows_that_finish_early_on_the_gpu_give_the_models_tokens_length_and_random_state():
    """The stop flags are read late on a GPU: the steps queued after every row had finished are
    dropped, and the tokens, their count and the generator afterwards are generate's own."""
    cfg = tr.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=8, n_positions=256, bos_token_id=1,
                        eos_token_id=[5, 6], pad_token_id=0)
    torch.manual_seed(0)
    model = tr.GPT2LMHeadModel(cfg).to(DEV).eval()
    gm = GraphedModule(model, decode=False)
    lengths = set()
    with torch.no_grad():
        for seed in range(6):
            for batch in (1, 3):
                ids = torch.randint(1, 5, (batch, 4), device=DEV)
                kw = dict(input_ids=ids, max_new_tokens=60, do_sample=True, temperature=1.5, top_p=0.9,
                          cache_implementation="static")
                torch.manual_seed(seed)
                want, after_want = model.generate(**kw, disable_compile=True), torch.rand(4, device=DEV)
                torch.manual_seed(seed)
                got, after_got = gm.generate(**kw), torch.rand(4, device=DEV)
                assert torch.equal(got, want), (seed, batch)
                assert torch.equal(after_got, after_want), "the generator stands where generate leaves it"
                lengths.add(want.shape[1])
    assert len(lengths) > 3 and min(lengths) < 4 + 60 - 8, "rows finished early, some before a first look"
    assert replays(gm) > 0 and gm.stats()["eager_calls"] == {}


def test_a_cache_on_another_device_raises_the_models_own_error():
    """A static cache filled on the CPU, a step on the GPU: the model's own error, eager or
    through graphwrap, and the cache left as the model leaves it."""
    model = _gpt2()
    on_cpu = _gpt2().cpu()
    on_cpu.load_state_dict(model.state_dict())
    gm = GraphedModule(model, decode=False)
    left = []
    for who in (model, gm):
        cache = tr.StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            on_cpu(input_ids=torch.randint(2, 1000, (1, 4)), past_key_values=cache, use_cache=True)
            with pytest.raises(RuntimeError, match="device"):
                who(input_ids=torch.randint(2, 1000, (1, 1), device=DEV), past_key_values=cache, use_cache=True)
        left.append([int(layer.cumulative_length) for layer in cache.layers])
    assert left[0] == left[1]
    torch.cuda.synchronize()


def test_generate_under_inference_mode_on_the_gpu():
    model = _gpt2()
    gm = GraphedModule(model, decode=False)
    kw = _greedy_request()
    with torch.no_grad():
        out = model.generate(**kw, disable_compile=True, output_logits=True, return_dict_in_generate=True)
    with torch.inference_mode():
        got = gm.generate(**kw)
    assert _same_or_tied(got, out.sequences, out.logits, 10)
    assert gm.stats()["eager_calls"] == {} and replays(gm) >= 10


_SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, pad_token_id=0)


def _family(name):
    """A small model of a family that decoded eagerly before (fp32), by transformers' class names."""
    configs = {
        "mistral": ("MistralConfig", "MistralForCausalLM", dict(_SMALL, sliding_window=8)),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_SMALL, sliding_window=8)),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_SMALL, sliding_window=8)),
        "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(vocab_size=100, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                                         pad_token_id=0)),
        "falcon": ("FalconConfig", "FalconForCausalLM", dict(vocab_size=100, hidden_size=64, num_hidden_layers=2,
                                                             num_attention_heads=4, pad_token_id=0)),
        "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=100, hidden_size=64, n_layer=2, n_head=4,
                                                          pad_token_id=0)),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_SMALL, num_local_experts=4, num_experts_per_tok=2)),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(_SMALL, num_experts=4, num_experts_per_tok=2,
                                                                     moe_intermediate_size=32,
                                                                     shared_expert_intermediate_size=64)),
    }
    config, model, kw = configs[name]
    if not hasattr(tr, model):
        pytest.skip(f"this transformers has no {model}")
    torch.manual_seed(0)
    return getattr(tr, model)(getattr(tr, config)(**kw)).to(DEV).eval()


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3", "gptj", "falcon", "bloom", "mixtral", "qwen2_moe"])
def test_families_that_decoded_eagerly_replay_every_step_with_generates_tokens(name, fp32_exact):
    """Sliding windows of 8 positions past their length (40 new tokens), models whose forward
    made tensors of Python numbers, mixtures of experts: two left-padded prompts, tokens equal
    model.generate's, every decode step a replay."""
    model = _family(name)
    gm = GraphedModule(model, decode=False)
    for prompt in (6, 13):
        ids = torch.randint(1, 100, (2, prompt), device=DEV)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=False)
        with torch.no_grad():
            want = model.generate(**kw)
            got = gm.generate(**kw, cache_implementation="static")
        assert torch.equal(got, want), name
    s = gm.stats()
    print(f"\n{name}: {replays(gm)} replays, eager {s['eager_calls']}, {s['generate']}")
    assert s["eager_calls"] == {} and replays(gm) >= 2 * 39 - 2


def test_tensors_of_python_numbers_made_in_a_capture_keep_their_values_over_replays():
    """A forward that makes tensors from Python numbers on the GPU (a scalar, a list, a list
    index) is captured; each replay gives what eager gives, long after the capture."""
    class Literal(nn.Module):
        def forward(self, x):
            scale = torch.tensor(0.5, device=x.device)
            shift = torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device)
            return (x[..., [3, 0]] * scale, x * scale + shift)

    m = Literal().to(DEV).eval()
    gm = GraphedModule(m, buckets=[4])
    for _ in range(3):
        x = torch.randn(3, 4, device=DEV)
        for got, want in zip(gm(x), m(x)):
            assert torch.equal(got, want)
    assert replays(gm) >= 2 and gm.stats()["eager_calls"] == {}


def test_generate_after_half_uses_a_cache_of_the_new_dtype():
    model = _gpt2()
    gm = GraphedModule(model, decode=False)
    kw = _greedy_request()
    with torch.no_grad():
        gm.generate(**kw)
        model.half()
        out = model.generate(**kw, disable_compile=True, output_logits=True, return_dict_in_generate=True)
        got = gm.generate(**kw)
    assert _same_or_tied(got, out.sequences, out.logits, 10)
    (cache,) = gm.__dict__["_gw_caches"].values()
    assert cache.layers[0].keys.dtype == torch.float16


def _seq2seq(name):
    torch.manual_seed(0)
    common = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)
    if name == "t5":
        model = tr.T5ForConditionalGeneration(tr.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                          num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                                                          eos_token_id=1))
    elif name in ("bart", "mvp"):  # MVP's positions: torch.arange over the cache's position (constants.py)
        config, cls = (tr.BartConfig, tr.BartForConditionalGeneration) if name == "bart" else (
            tr.MvpConfig, tr.MvpForConditionalGeneration)
        model = cls(config(**common, max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                           decoder_start_token_id=2, forced_eos_token_id=None))
    else:
        model = tr.WhisperForConditionalGeneration(tr.WhisperConfig(
            **common, num_mel_bins=16, max_source_positions=32, max_target_positions=64, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=[], begin_suppress_tokens=[]))
    return model.to(DEV).eval()


def _seq2seq_request(name, i):
    """The ``i``-th request of the encoder-decoder tests: 20 new tokens over 2 rows (audio features
    for Whisper, else prompts of 10 + 3i tokens)."""
    if name == "whisper":
        kw = dict(input_features=torch.randn(2, 16, 64, device=DEV))
    else:
        ids = torch.randint(3, 60, (2, 10 + 3 * i), device=DEV)
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    return dict(kw, max_new_tokens=20, min_new_tokens=20, do_sample=False)


@pytest.mark.parametrize("name", ["t5", "bart", "mvp", "whisper"])
def test_encoder_decoders_replay_every_step_with_generates_tokens(name, fp32_exact):
    """The encoder once per request, every decoder step a replay over graphwrap's own cache of
    two parts; a second request, under inference_mode and of another encoder length in the same
    bucket of 64 (the encoder's output and mask padded), replays the first one's graphs."""
    model = _seq2seq(name)
    gm = GraphedModule(model, decode=False)
    for i in range(2):
        kw = _seq2seq_request(name, i)
        with torch.no_grad():
            want = model.generate(**kw)
        with torch.inference_mode() if i else torch.no_grad():  # the second request under inference_mode
            got = gm.generate(**kw, cache_implementation="static")
        assert torch.equal(got, want), name
    s = gm.stats()
    print(f"\n{name}: {replays(gm)} replays, eager {s['eager_calls']}, {s['generate']}")
    assert s["eager_calls"] == {} and replays(gm) >= 2 * 19 - 2
    assert len(s["keys"]) == 1, "the second request replays the first one's graphs"
    assert gm.__dict__.get("_gw_pads") is (None if name == "whisper" else True)


@pytest.mark.parametrize("name", ["t5", "bart", "whisper"])
def test_an_encoder_decoders_default_call_replays_with_generates_tokens(name, fp32_exact):
    """No cache_implementation, the shared batch on (it does not serve encoder-decoders): the
    call's turn runs over graphwrap's own static cache, every step a replay."""
    model = _seq2seq(name)
    gm = GraphedModule(model)
    for i in range(2):
        kw = _seq2seq_request(name, i)
        with torch.no_grad():
            want = model.generate(**kw)
        assert torch.equal(gm.generate(**kw), want), name
    s = gm.stats()
    assert s["generate"] == {"graphwrap's decode loop": 2}, s["generate"]
    assert s["eager_calls"] == {} and replays(gm) >= 2 * 19 - 2


@pytest.mark.parametrize("name", ["t5", "bart", "whisper"])
def test_concurrent_encoder_decoder_calls_share_a_turn_of_replays_with_generates_tokens(name, fp32_exact):
    """Eight default calls waiting for the turn together (graphwrap/decoding/callers/turns.py): one
    generate over their 16 rows (text prompts of 10, 13 and 16 tokens, padded), every step a
    replay, each call's tokens its own alone. (Rows ending at different places, and the split
    there: tests/test_generate_turns_cpu.py.)"""
    from graphwrap.decoding.callers import turns

    model = varied_weights(_seq2seq(name))  # (each input its own tokens)
    gm = GraphedModule(model)
    settings = ("max_new_tokens", "min_new_tokens", "do_sample")
    calls = [{k: v for k, v in _seq2seq_request(name, i % 3).items() if k not in settings} for i in range(8)]
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    if name == "whisper":
        kw["pad_token_id"] = model.generation_config.eos_token_id  # (joined where its pad is its end)
    want = generate_alone(model, calls, kw)
    got = held_turn(turns.turns_of(model), 8, lambda i: gm.generate(**calls[i], **kw))
    for i in range(8):
        assert torch.equal(got[i], want[i]), (name, i, got[i])
    s = gm.stats()
    assert s["generate_turns"]["joined_calls"] == 8 and s["generate"] == {"graphwrap's decode loop": 8}, s
    assert s["eager_calls"] == {} and 10 <= replays(gm) <= 12, "one run's 12 steps (eight runs alone: 8x)"


def test_whispers_long_form_replays_each_segment_with_generates_tokens(fp32_exact, monkeypatch):
    """Audio longer than the encoder's window: transformers' long-form path decodes it segment
    by segment, each segment in graphwrap's loop, its steps replayed."""
    import graphwrap.loops.decode as decode

    model = _seq2seq("whisper")
    g = model.generation_config
    g.no_timestamps_token_id, g.is_multilingual, g.max_initial_timestamp_index = 3, False, 5
    features = torch.randn(1, 16, 200, device=DEV)
    kw = dict(input_features=features, attention_mask=torch.ones(1, 200, dtype=torch.long, device=DEV),
              max_new_tokens=10, do_sample=False, return_timestamps=True)
    with torch.no_grad():
        want = model.generate(**kw)
    loops = []
    steps = decode._steps
    monkeypatch.setattr(decode, "_steps", lambda *a, **k: loops.append(1) or steps(*a, **k))
    gm = GraphedModule(model, decode=False)
    got = gm.generate(**kw, cache_implementation="static")
    print(f"\nlong-form: {len(loops)} segments, {replays(gm)} replays, {got.shape[1]} tokens")
    assert torch.equal(got, want)
    assert len(loops) >= 2 and replays(gm) >= len(loops) and not gm.stats()["eager_calls"]
