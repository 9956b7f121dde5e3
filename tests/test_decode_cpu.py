"""Decode loops on the CPU stand-in for graphs: a static cache as state written in place, keyed
by the cache object, never padded; gm.generate against model.generate; a growing cache eager
with its reason. Needs transformers (skipped with the reason without it)."""

import threading

import pytest
import torch
from helpers import on_cpu_graphs, replays
from torch import nn

from graphwrap import GraphedModule, GraphwrapError
from graphwrap.core.state import (
    DYNAMIC_CACHE,
    NOT_ALLOCATED,
    NOT_STATE,
    StateRef,
    state_reason,
)

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")


def _gpt2():
    cfg = tr.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=128, bos_token_id=1,
                        eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return tr.GPT2LMHeadModel(cfg).eval()


def test_which_objects_are_state():
    model = _gpt2()
    static = tr.StaticCache(config=model.config, max_cache_len=16)
    assert state_reason(static) == NOT_ALLOCATED, "its tensors come with the first call"
    ids = torch.randint(1, 100, (2, 4))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=static, use_cache=True)
    assert state_reason(static) is None
    assert state_reason(tr.DynamicCache()) == DYNAMIC_CACHE
    assert state_reason(object()) is NOT_STATE and state_reason([1]) is NOT_STATE
    a, b = StateRef(static), StateRef(static)
    assert a == b and hash(a) == hash(b) and len(a.ptrs) >= 2 * model.config.n_layer
    static.layers[0].keys = static.layers[0].keys.clone()  # allocated again: another key
    assert StateRef(static) != a


@pytest.mark.parametrize("batch", [1, 3])
def test_generate_gives_the_models_tokens_with_every_decode_step_replayed(batch):
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    for prompt in (5, 9):  # a second generate, another prompt: the same cache and graphs
        ids = torch.randint(1, 100, (batch, prompt))
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        with torch.no_grad():
            want = model.generate(**kw, cache_implementation="static")
            got = gm.generate(**kw, cache_implementation="static")
        assert torch.equal(got, want)
    s = gm.stats()
    assert len(s["keys"]) == 1 and "StaticCache" in s["keys"][0]["key"]
    assert replays(gm) == 2 * 7, "every step after the prompt's first token replays"
    assert list(s["keys"][0]["buckets"]) == [1], "one call a step, never padded"
    assert s["eager_calls"] == {}


@pytest.mark.parametrize("family", ["gpt2", "bart", "whisper"])
def test_graphwraps_loop_replays_the_kept_plan_of_its_kept_inputs(family, monkeypatch):
    """The loop keeps each step's inputs (but the new tokens) and hands them to a Repeat: the
    first step goes the direct way, every later one replays the plan it kept."""
    import graphwrap.loops.repeat as repeat

    made = []
    init = repeat.Repeat.__init__

    def noted(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(repeat.Repeat, "__init__", noted)
    if family == "whisper":
        model, kw = _tiny_whisper(), dict(input_features=torch.randn(2, 16, 64))
    else:
        model = _gpt2() if family == "gpt2" else _encoder_decoders()["bart"]().eval()
        ids = torch.randint(3, 60, (2, 6))
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    kw.update(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    with torch.no_grad():
        want = model.generate(**kw, cache_implementation="static") if family != "whisper" else model.generate(**kw)
        for _ in range(2):
            assert torch.equal(gm.generate(**kw, cache_implementation="static"), want)
    assert [r.calls for r in made] == [8, 8], "per request: 9 steps, the first direct"
    assert replays(gm) == 2 * 9 and gm.stats()["eager_calls"] == {}


def test_sampling_gives_the_models_tokens_under_the_same_seed():
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    ids = torch.randint(1, 100, (2, 6))
    kw = dict(input_ids=ids, max_new_tokens=10, do_sample=True, top_k=20, temperature=0.8,
              cache_implementation="static")
    with torch.no_grad():
        torch.manual_seed(5)
        want = model.generate(**kw)
        torch.manual_seed(5)
        got = gm.generate(**kw)
    assert torch.equal(got, want)


def test_a_growing_cache_runs_eagerly_and_says_to_use_a_static_one():
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, decode=False))
    ids = torch.randint(1, 100, (1, 5))
    with torch.no_grad():
        want = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
        got = gm.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want)
    assert gm.stats()["eager_calls"] == {DYNAMIC_CACHE: 4}
    assert 'cache_implementation="static"' in DYNAMIC_CACHE


def test_generate_leaves_the_model_as_it_was():
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, decode=False))
    ids = torch.randint(1, 100, (1, 5))
    with torch.no_grad():
        gm.generate(input_ids=ids, max_new_tokens=3, do_sample=False, cache_implementation="static")
    assert "get_compiled_call" not in model.__dict__ and "_valid_auto_compile_criteria" not in model.__dict__
    with pytest.raises(Exception, match="no generate"):
        GraphedModule(nn.Linear(2, 2)).generate(torch.zeros(1, 2))


def test_a_step_on_a_cache_of_another_batch_size_raises_the_models_own_error():
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    cache = tr.StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(input_ids=torch.randint(1, 100, (2, 4)), past_key_values=cache, use_cache=True)
        step = dict(past_key_values=cache, use_cache=True, cache_position=torch.tensor([4]))
        with pytest.raises(Exception) as eager_error:
            model(input_ids=torch.randint(1, 100, (3, 1)), **step)
        eager_left = [int(layer.cumulative_length) for layer in cache.layers]
        cache.reset()
        model(input_ids=torch.randint(1, 100, (2, 4)), past_key_values=cache, use_cache=True)
        with pytest.raises(type(eager_error.value)):
            gm(input_ids=torch.randint(1, 100, (3, 1)), **step)
        assert [int(layer.cumulative_length) for layer in cache.layers] == eager_left, "left as the module leaves it"
        cache.reset()
        model(input_ids=torch.randint(1, 100, (2, 4)), past_key_values=cache, use_cache=True)
        ok = gm(input_ids=torch.randint(1, 100, (2, 1)), **step)  # the cache's own batch still serves
    assert ok.logits.shape == (2, 1, 100)


def _small_vocab(eos):
    cfg = tr.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=8, n_positions=128, bos_token_id=1,
                        eos_token_id=eos, pad_token_id=0)
    torch.manual_seed(0)
    return tr.GPT2LMHeadModel(cfg).eval()


def test_rows_that_finish_early_give_the_models_tokens_length_and_random_state():
    """Steps run past the one after which every row had finished are dropped: the tokens, their
    count and the random generator afterwards are generate's own."""
    model = _small_vocab(eos=[5, 6])
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    lengths = set()
    for seed in range(8):
        for batch in (1, 2):
            ids = torch.randint(1, 5, (batch, 4))
            kw = dict(input_ids=ids, max_new_tokens=40, do_sample=True, temperature=1.5, top_p=0.9,
                      cache_implementation="static")
            with torch.no_grad():
                torch.manual_seed(seed)
                want, after_want = model.generate(**kw), torch.rand(4)
                torch.manual_seed(seed)
                got, after_got = gm.generate(**kw), torch.rand(4)
            assert torch.equal(got, want), (seed, batch)
            assert torch.equal(after_got, after_want), "the generator stands where generate leaves it"
            lengths.add(want.shape[1])
    assert len(lengths) > 3 and max(lengths) < 44, "rows finished early, at different steps"
    assert replays(gm) > 0 and gm.stats()["eager_calls"] == {}


def _llama(eos):
    cfg = tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=8, pad_token_id=0, eos_token_id=eos)
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("make", [_small_vocab, _llama], ids=["gpt2", "llama"])
def test_left_padded_prompts_and_an_end_token_with_the_mask_built_inside_the_graph(make):
    """Each step hands the model the 2D mask over the whole cache, and the forward builds the
    4D mask that generate builds on the host: one key for every step, generate's tokens."""
    model = make(eos=7)
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    ids = torch.randint(1, 7, (3, 6))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        assert torch.equal(gm.generate(**kw), model.generate(**kw))
    (key,) = gm.stats()["keys"]
    assert "attention_mask=Tensor[3, 64]" in key["key"] and replays(gm) == 19


def test_requests_the_loop_does_not_serve_run_transformers_loop_with_the_steps_graphed(gw_log):
    """A streamer needs each token on the host as it comes: transformers' own loop serves it,
    each step still a replay, and the log says why."""
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    ids = torch.randint(1, 100, (1, 5))
    seen = []

    class Streamer:
        def put(self, value):
            seen.append(value)

        def end(self):
            seen.append("end")

    kw = dict(input_ids=ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        want = model.generate(**kw)
        got = gm.generate(**kw, streamer=Streamer())
    assert torch.equal(got, want) and seen[-1] == "end" and len(seen) == 1 + 6 + 1
    assert replays(gm) == 5
    assert any("streamer= is given" in r.getMessage() for r in gw_log.records)
    gw_log.clear()
    with torch.no_grad():
        gm.generate(**kw)
    assert not any("transformers' own loop" in r.getMessage() for r in gw_log.records)


def test_outputs_held_across_steps_never_make_slots_that_run_the_step_again():
    """A caller that keeps every step's output holds every owned-output slot: another slot would
    be a capture that runs the step (and writes the cache) beside the calls. Outputs are cloned
    instead, and the cache stays the model's."""
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    mine, ref = (tr.StaticCache(config=model.config, max_cache_len=32) for _ in range(2))
    ids = torch.randint(1, 100, (2, 4))
    held = []
    with torch.no_grad():
        for cache in (mine, ref):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        for _ in range(8):
            tok = torch.randint(1, 100, (2, 1))
            got = gm(input_ids=tok, past_key_values=mine, use_cache=True)
            want = model(input_ids=tok, past_key_values=ref, use_cache=True)
            held.append(got.logits)
            assert torch.equal(got.logits, want.logits)
        gm.wait()
    for a, b in zip(mine.layers, ref.layers):
        assert torch.equal(a.keys, b.keys) and int(a.cumulative_length) == int(b.cumulative_length) == 12
    assert replays(gm) >= 6


def test_a_cache_too_short_for_the_request_is_refused_before_any_step():
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    cache = tr.StaticCache(config=model.config, max_cache_len=8)
    ids = torch.randint(1, 100, (1, 5))
    with torch.no_grad(), pytest.raises(GraphwrapError, match=r"holds 8 positions.*needs 15.*max_cache_len >= 15"):
        gm.generate(input_ids=ids, past_key_values=cache, max_new_tokens=10, do_sample=False)
    assert int(cache.layers[0].cumulative_length) == 0 and replays(gm) == 0, "nothing ran"
    with torch.no_grad():  # one that fits runs, with the user's cache (transformers' loop, graphed steps)
        want = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
        assert torch.equal(gm.generate(input_ids=ids, past_key_values=cache, max_new_tokens=3, do_sample=False), want)


def test_a_step_past_the_end_of_the_cache_raises_the_models_own_error():
    """On a GPU the model's own error is a device-side assert, eager or graphed alike; generate
    never gets there (its cache is sized for the request, or a short one is refused)."""
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    for who in (model, gm):
        cache = tr.StaticCache(config=model.config, max_cache_len=8)
        with torch.no_grad():
            who(input_ids=torch.randint(1, 100, (1, 8)), past_key_values=cache, use_cache=True)
            with pytest.raises(IndexError, match="out of bounds"):
                who(input_ids=torch.randint(1, 100, (1, 1)), past_key_values=cache, use_cache=True)


def test_generate_from_several_threads_takes_turns_and_gives_each_its_tokens():
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    prompts = [torch.randint(1, 100, (2, 5 + i % 3)) for i in range(6)]
    kw = dict(max_new_tokens=8, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        want = [model.generate(input_ids=p, **kw) for p in prompts]
    got = [None] * len(prompts)

    def run(i):
        with torch.no_grad():
            got[i] = gm.generate(input_ids=prompts[i], **kw)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert len(gm.__dict__["_gw_caches"]) == 1, "one cache for the batch size, used in turn"


def test_generate_under_inference_mode_and_after_it():
    """The prompt's forward allocates the static cache: graphwrap runs generate outside
    inference_mode, so the cache is one its captures can write."""
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    ids = torch.randint(1, 100, (2, 6))
    kw = dict(input_ids=ids, max_new_tokens=10, do_sample=False, cache_implementation="static")
    with torch.inference_mode():
        want = model.generate(**kw)
        assert torch.equal(gm.generate(**kw), want)
    assert torch.equal(gm.generate(**kw), want)
    assert replays(gm) == 2 * 9 and gm.stats()["eager_calls"] == {}


def test_a_cache_made_under_inference_mode_runs_eagerly_with_the_reason():
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    caches = [tr.StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    prompt = torch.randint(1, 100, (1, 4))
    with torch.inference_mode():
        for c in caches:
            model(input_ids=prompt, past_key_values=c, use_cache=True)
        for _ in range(3):
            tok = torch.randint(1, 100, (1, 1))
            got = gm(input_ids=tok, past_key_values=caches[0], use_cache=True)
            assert torch.equal(got.logits, model(input_ids=tok, past_key_values=caches[1], use_cache=True).logits)
    (reason,) = gm.stats()["eager_calls"]
    assert "inference_mode" in reason and replays(gm) == 0


def test_generate_sees_weights_replaced_after_capture():
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    ids = torch.randint(1, 100, (1, 6))
    kw = dict(input_ids=ids, max_new_tokens=10, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        gm.generate(**kw)
        model.transformer.h[0].mlp.c_fc.weight = nn.Parameter(torch.randn_like(model.transformer.h[0].mlp.c_fc.weight))
        assert torch.equal(gm.generate(**kw), model.generate(**kw))


def _sliding(kind):
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=100, sliding_window=8, pad_token_id=0)
    if kind == "mistral":
        return tr.MistralForCausalLM(tr.MistralConfig(**small))
    return tr.Gemma2ForCausalLM(tr.Gemma2Config(head_dim=16, **small))


def _sliding_request(kind):
    """A windowed model, its GraphedModule on the CPU stand-in for graphs, two left-padded prompts."""
    if not hasattr(tr, "MistralForCausalLM") or not hasattr(tr, "Gemma2ForCausalLM"):
        pytest.skip("this transformers has no Mistral or Gemma2")
    torch.manual_seed(0)
    model = _sliding(kind).eval()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    ids = torch.randint(1, 100, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return model, gm, ids, mask


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_a_sliding_window_replays_with_graphwraps_ring_and_masks(kind):
    """graphwrap's own cache keeps a window as a ring whose position lives on the device, and
    the loop keeps the masks: every step replays, with generate's tokens (past the window)."""
    model, gm, ids, mask = _sliding_request(kind)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        assert torch.equal(gm.generate(**kw), model.generate(**kw))
    assert gm.stats()["eager_calls"] == {} and replays(gm) >= 18


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_a_sliding_window_cache_that_keeps_its_position_in_python_runs_eagerly(kind):
    """transformers' own sliding-window layer (in a cache the caller passes) counts its position
    in a Python int as well: a graph would replay that number frozen (generate gave other tokens
    from the third step on). Such steps run eagerly, with the reason, and give generate's
    tokens."""
    model, gm, ids, mask = _sliding_request(kind)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    with torch.no_grad():
        want = model.generate(**kw, past_key_values=tr.StaticCache(config=model.config, max_cache_len=32))
        got = gm.generate(**kw, past_key_values=tr.StaticCache(config=model.config, max_cache_len=32))
    assert torch.equal(got, want)
    (reason,) = gm.stats()["eager_calls"]
    assert "cumulative_length_int" in reason and "frozen" in reason and replays(gm) == 0


@pytest.mark.parametrize("extra", [dict(use_cache=False), dict(repetition_penalty=1.3, min_new_tokens=4),
                                   dict(max_length=14, max_new_tokens=None)],
                         ids=["no cache", "processors", "max_length"])
def test_other_generate_arguments_give_the_models_tokens(extra):
    """Logits processors run as generate runs them; without a cache the model runs as generate
    runs it (no cache of graphwrap's is made); a max_length in place of max_new_tokens."""
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    kw = dict(input_ids=torch.randint(1, 100, (2, 6)), max_new_tokens=8, do_sample=False,
              cache_implementation="static")
    kw.update(extra)
    kw = {k: v for k, v in kw.items() if v is not None}
    with torch.no_grad():
        assert torch.equal(gm.generate(**kw), model.generate(**kw))
    assert ("use_cache" in extra) == (replays(gm) == 0)


def test_generate_after_the_model_changes_dtype_uses_a_cache_of_the_new_one():
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    kw = dict(input_ids=torch.randint(1, 100, (2, 6)), max_new_tokens=8, do_sample=False,
              cache_implementation="static")
    with torch.no_grad():
        gm.generate(**kw)
        model.to(torch.bfloat16)
        assert torch.equal(gm.generate(**kw), model.generate(**kw))
    (cache,) = gm.__dict__["_gw_caches"].values()
    assert cache.layers[0].keys.dtype == torch.bfloat16


def _encoder_decoders():
    """Tiny random encoder-decoders of four families."""
    common = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128)
    return {
        "t5": lambda: tr.T5ForConditionalGeneration(tr.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
            pad_token_id=0, eos_token_id=1)),
        "bart": lambda: tr.BartForConditionalGeneration(tr.BartConfig(
            **common, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)),
        "marian": lambda: tr.MarianMTModel(tr.MarianConfig(
            **common, pad_token_id=63, eos_token_id=2, decoder_start_token_id=63)),
        "mbart": lambda: tr.MBartForConditionalGeneration(tr.MBartConfig(
            **common, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)),
    }


@pytest.mark.parametrize("family", ["t5", "bart", "marian", "mbart"])
def test_encoder_decoders_replay_every_step_over_a_cache_of_graphwraps_own(family):
    """The encoder runs once per request; every decode step replays, over a self-attention and
    a cross-attention cache that graphwrap keeps: a second request of the same lengths replays
    the graphs the first captured, a third of another encoder length in the same bucket of 64
    (its output and mask padded) too, a fourth past 64 gets a cache of its own."""
    torch.manual_seed(0)
    model = _encoder_decoders()[family]().eval()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    for i, length in enumerate((10, 10, 7, 70)):
        ids = torch.randint(3, 60, (2, length))
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                  do_sample=False)
        with torch.no_grad():
            want = model.generate(**kw, cache_implementation="static")
        got = gm.generate(**kw, cache_implementation="static")
        assert torch.equal(got, want)
        assert replays(gm) == 19 * (i + 1), "every step but the prompt's replays"
        assert gm.stats()["eager_calls"] == {}
    assert gm.stats()["generate"] == {"graphwrap's decode loop": 4}
    caches = gm.__dict__["_gw_caches"]
    assert sorted(k[3] for k in caches) == [64, 128], "one cache per bucket of encoder lengths"
    assert len(gm.stats()["keys"]) == 2 and gm.__dict__["_gw_pads"] is True


@pytest.mark.parametrize("family", ["t5", "bart", "marian", "mbart", "whisper"])
def test_an_encoder_decoders_default_call_replays_over_a_cache_of_graphwraps_own(family):
    """The call people write, with no cache_implementation: the shared batch does not serve an
    encoder-decoder, and its turn in the one-call loop gets graphwrap's own static cache (every
    step a replay) with the tokens of generate's own cache."""
    torch.manual_seed(0)
    model = _tiny_whisper() if family == "whisper" else _encoder_decoders()[family]().eval()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False))
    for _ in range(2):
        if family == "whisper":
            kw = dict(input_features=torch.randn(2, 16, 64), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        else:
            ids = torch.randint(3, 60, (2, 10))
            kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                      do_sample=False)
        with torch.no_grad():
            want = model.generate(**kw)
        assert torch.equal(gm.generate(**kw), want)
    assert gm.stats()["generate"] == {"graphwrap's decode loop": 2}, gm.stats()["generate"]
    assert replays(gm) == 2 * 11 and gm.stats()["eager_calls"] == {}


def test_a_default_call_keeps_the_cache_it_asks_for():
    from graphwrap.loops.decode import default_static

    bart = _encoder_decoders()["bart"]().eval()
    assert default_static(bart, {"max_new_tokens": 3})["cache_implementation"] == "static"
    for kw in ({"cache_implementation": "dynamic"}, {"use_cache": False}, {"num_beams": 2}):
        assert default_static(bart, kw) == kw
    bart.generation_config.num_beams = 4  # a checkpoint's beam search
    assert "cache_implementation" not in default_static(bart, {})
    llama = tr.LlamaForCausalLM(tr.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, vocab_size=64))
    assert default_static(llama, {"max_new_tokens": 3}) == {"max_new_tokens": 3}, "decoder-only: as asked"


def test_an_encoder_decoders_own_caches_are_bounded_by_max_keys(gw_log):
    torch.manual_seed(0)
    model = _encoder_decoders()["bart"]().eval()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False, max_keys=1))
    for length in (5, 70, 6):  # buckets of 64, 128 and 64 encoder positions
        ids = torch.randint(3, 60, (1, length))
        kw = dict(input_ids=ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        with torch.no_grad():
            want = model.generate(**kw)
        assert torch.equal(gm.generate(**kw, cache_implementation="static"), want)
    assert len(gm.__dict__["_gw_caches"]) == 1
    assert any("max_keys" in why for why in gm.stats()["eager_calls"]), gm.stats()["eager_calls"]


def _unpadded_requests(model, lengths):
    """gm.generate over requests of these encoder lengths, each giving generate's tokens, where
    nothing may be padded: one cache per encoder length. The GraphedModule."""
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    for length in lengths:
        ids = torch.randint(3, 60, (2, length))
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                  do_sample=False)
        with torch.no_grad():
            want = model.generate(**kw)
        assert torch.equal(gm.generate(**kw, cache_implementation="static"), want)
    assert gm.__dict__["_gw_pads"] is False
    assert sorted(k[3] for k in gm.__dict__["_gw_caches"]) == sorted(set(lengths))
    return gm


def test_a_decoder_that_reads_padded_encoder_positions_keeps_a_cache_per_length(gw_log):
    """The first request whose encoder output would be padded runs the decoder's first step on
    both: a decoder that ignores the encoder's mask (here BART's, made to) gives other logits,
    so nothing is padded and each length keeps its own cache; the tokens are generate's."""
    torch.manual_seed(0)
    model = _encoder_decoders()["bart"]().eval()
    decoder = model.model.decoder
    forward = decoder.forward
    decoder.forward = lambda *a, **k: forward(*a, **{**k, "encoder_attention_mask": None})
    gm = _unpadded_requests(model, (10, 7, 10))
    assert any("not padded to length buckets" in r.getMessage() for r in gw_log.records)
    assert gm.stats()["eager_calls"] == {}


def test_a_preparation_that_drops_the_encoders_mask_keeps_a_cache_per_length(gw_log):
    """A model whose prepare_inputs_for_generation leaves the encoder's mask out (its forward
    would read padded positions) gets nothing padded; the tokens are generate's."""
    torch.manual_seed(0)
    model = _encoder_decoders()["t5"]().eval()
    prepare = model.prepare_inputs_for_generation

    def dropping(input_ids, next_sequence_length=None, **kwargs):
        inputs = prepare(input_ids, next_sequence_length=next_sequence_length, **kwargs)
        inputs.pop("attention_mask", None)
        return inputs

    model.prepare_inputs_for_generation = dropping
    _unpadded_requests(model, (10, 7))
    assert any("does not pass the encoder's mask on" in r.getMessage() for r in gw_log.records)


def _tiny_whisper():
    """Whisper with 16 mel bins and a window of 64 frames."""
    cfg = tr.WhisperConfig(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                           max_source_positions=32, max_target_positions=64, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, decoder_start_token_id=1, suppress_tokens=[], begin_suppress_tokens=[])
    torch.manual_seed(0)
    return tr.WhisperForConditionalGeneration(cfg).eval()


def test_whisper_decodes_input_features_in_graphwraps_loop():
    """Whisper's own generate hands custom_generate on to transformers', and its preparation
    hands next_sequence_length on: its steps replay."""
    model = _tiny_whisper()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    features = torch.randn(2, 16, 64)
    kw = dict(input_features=features, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with torch.no_grad():
        want = model.generate(**kw)
    got = gm.generate(**kw, cache_implementation="static")
    assert torch.equal(got, want)
    assert gm.stats()["generate"] == {"graphwrap's decode loop": 1}
    assert replays(gm) == 11


def test_whispers_long_form_runs_each_segment_in_graphwraps_loop(monkeypatch):
    """Audio longer than the encoder's window (transformers' long-form path: generate_with_fallback
    decodes it segment by segment, each a generate call of its own): every segment runs
    graphwrap's loop and replays its steps, and the tokens are model.generate's."""
    import graphwrap.loops.decode as decode

    model = _tiny_whisper()
    g = model.generation_config
    g.no_timestamps_token_id, g.is_multilingual, g.max_initial_timestamp_index = 3, False, 5
    features = torch.randn(1, 16, 200)  # the window is 64 frames: long-form
    kw = dict(input_features=features, attention_mask=torch.ones(1, 200, dtype=torch.long), max_new_tokens=10,
              do_sample=False, return_timestamps=True)
    with torch.no_grad():
        want = model.generate(**kw)
    loops = []
    steps = decode._steps
    monkeypatch.setattr(decode, "_steps", lambda *a, **k: loops.append(1) or steps(*a, **k))
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    got = gm.generate(**kw, cache_implementation="static")
    assert torch.equal(got, want)
    assert len(loops) >= 2, "one loop per segment"
    assert replays(gm) >= len(loops) and not gm.stats()["eager_calls"]


def test_an_encoder_decoder_cache_is_state_its_cross_flags_watched():
    """Both of its caches' tensors are the state; its is_updated flags (host bools the prompt's
    forward sets) are among the numbers watched; a growing part is refused with the reason."""
    from graphwrap.core.state import state_numbers, state_tensors

    torch.manual_seed(0)
    model = _encoder_decoders()["bart"]().eval()
    cfg = model.config
    cache = tr.EncoderDecoderCache(tr.StaticCache(config=cfg, max_cache_len=16), tr.StaticCache(config=cfg, max_cache_len=6))
    assert state_reason(cache) == NOT_ALLOCATED
    ids = torch.randint(3, 60, (1, 6))
    with torch.no_grad():
        model(input_ids=ids, decoder_input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    assert state_reason(cache) is None
    tensors = state_tensors(cache)
    assert len(tensors) == 2 * 2 * 3, "keys, values and the position of each layer of both caches"
    assert {t.shape[2] for t in tensors if t.dim() == 4} == {16, 6}
    flags = [n for n in state_numbers(cache) if n.name.startswith("EncoderDecoderCache.is_updated")]
    assert len(flags) == 2 and all(n.value is True for n in flags)
    grows = tr.EncoderDecoderCache(tr.DynamicCache(), tr.DynamicCache())
    assert state_reason(grows) == DYNAMIC_CACHE


def test_a_preparation_passing_next_sequence_length_on_is_recognised():
    from graphwrap.loops.decode import _takes_next_length

    class Base:
        def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, **kwargs):
            return kwargs

    class HandsOn(Base):
        def prepare_inputs_for_generation(self, input_ids, **kwargs):
            kwargs["extra"] = 1
            return super().prepare_inputs_for_generation(input_ids, **kwargs)

    class Keeps(Base):
        def prepare_inputs_for_generation(self, input_ids, **kwargs):
            return dict(kwargs, input_ids=input_ids)  # next_sequence_length would reach the forward

    class Fixed(Base):
        def prepare_inputs_for_generation(self, input_ids, attention_mask=None):
            return super().prepare_inputs_for_generation(input_ids)

    assert _takes_next_length(Base().prepare_inputs_for_generation)
    assert _takes_next_length(HandsOn().prepare_inputs_for_generation)
    assert not _takes_next_length(Keeps().prepare_inputs_for_generation)
    assert not _takes_next_length(Fixed().prepare_inputs_for_generation)


def _steps_seen(gm) -> int:
    """Forward calls that reached graphwrap's engine: replayed, or run eagerly with a reason."""
    return replays(gm) + sum(gm.stats()["eager_calls"].values())


@pytest.mark.parametrize("request_kw", [
    {},  # the default cache, which grows: transformers' loop
    {"max_length": 20},
    {"return_dict_in_generate": True},
    {"streamer": "streamer"},
], ids=["dynamic-cache", "max_length", "return_dict", "streamer"])
def test_every_step_of_transformers_own_loop_reaches_graphwrap(request_kw):
    """Under transformers 5.24 the cache keyword is ``cache``; graphwrap's hook looked for
    ``past_key_values`` and 0 of 15 steps reached it, with no reason given."""
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    ids = torch.randint(1, 100, (1, 5))
    kw = dict(input_ids=ids, do_sample=False, **request_kw)
    if "max_length" not in kw:
        kw["max_new_tokens"] = 15
    if kw.get("streamer") == "streamer":
        kw["streamer"] = tr.generation.streamers.BaseStreamer()
        kw["streamer"].put = kw["streamer"].end = lambda *a, **k: None
    with torch.no_grad():
        want = model.generate(**kw)
        got = gm.generate(**kw)
    seqs = got.sequences if request_kw.get("return_dict_in_generate") else got
    assert torch.equal(seqs, want.sequences if request_kw.get("return_dict_in_generate") else want)
    assert _steps_seen(gm) == 14, "every step after the prompt's first token"
    (how,) = gm.stats()["generate"]
    assert how.startswith("transformers' loop, steps handed to graphwrap")


def test_graphwraps_own_loop_keeps_a_2d_mask_and_the_installed_cache_keyword(recwarn):
    """The kept inputs (a 2D mask the forward extends inside the graph) hold the cache under the
    keyword this transformers uses; graphwrap passes no deprecated keyword of its own."""
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    ids = torch.randint(1, 100, (2, 5))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    with torch.no_grad():
        want = model.generate(**kw, cache_implementation="static")
        got = gm.generate(**kw, cache_implementation="static")
    assert torch.equal(got, want)
    (key,) = [k["key"] for k in gm.stats()["keys"]]
    assert "attention_mask=Tensor[2, 64]" in key, key
    assert gm.stats()["generate"] == {"graphwrap's decode loop": 1}
    assert not [w for w in recwarn if "past_key_values" in str(w.message) and "deprecated" in str(w.message)]


def test_a_too_short_cache_is_refused_under_either_keyword():
    from graphwrap.loops.decode import cache_keyword

    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    ids = torch.randint(1, 100, (1, 5))
    cache = tr.StaticCache(config=model.config, max_cache_len=8)
    with torch.no_grad(), pytest.raises(GraphwrapError, match=r"holds 8 positions.*needs 15"):
        gm.generate(input_ids=ids, max_new_tokens=10, do_sample=False, **{cache_keyword(model): cache})


def test_beam_search_steps_that_never_reach_graphwrap_say_so():
    """transformers' beam search calls the model itself, past every hook graphwrap uses: its
    tokens are the model's, and stats() says no step reached graphwrap, and why."""
    model = _gpt2()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    ids = torch.randint(1, 100, (1, 5))
    kw = dict(input_ids=ids, max_new_tokens=6, do_sample=False, num_beams=2)
    with torch.no_grad():
        assert torch.equal(gm.generate(**kw), model.generate(**kw))
    assert _steps_seen(gm) == 0
    # beam search the model's own generation config asks for (FSMT's does): said the same way
    model.generation_config.num_beams = 2
    del kw["num_beams"]
    with torch.no_grad():
        assert torch.equal(gm.generate(**kw, cache_implementation="static"), model.generate(**kw))
    assert _steps_seen(gm) == 0
    assert gm.stats()["generate"] == {
        "transformers' loop, no step reached graphwrap: it called the model itself "
        "(beam search or several sequences per prompt)": 2}


def test_an_encoder_decoder_under_inference_mode_and_from_threads():
    """Calls as users make them: under torch.inference_mode(), and from four threads at once
    (they take turns on the model); each gets the model's tokens, the steps replay."""
    torch.manual_seed(0)
    model = _encoder_decoders()["bart"]().eval()
    gm = on_cpu_graphs(GraphedModule(model, eager_if_faster=False, decode=False))
    prompts = [torch.randint(3, 60, (2, 8)) for _ in range(4)]
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    with torch.no_grad():
        want = [model.generate(input_ids=p, **kw) for p in prompts]
    with torch.inference_mode():
        assert torch.equal(gm.generate(input_ids=prompts[0], **kw, cache_implementation="static"), want[0])
    got = [None] * 4

    def run(i):
        with torch.no_grad():
            got[i] = gm.generate(input_ids=prompts[i], **kw, cache_implementation="static")
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert replays(gm) == 5 * 9 and gm.stats()["eager_calls"] == {}
