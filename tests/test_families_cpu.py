"""Model families in the one-call decode loop, on a CPU: sliding windows as rings with the
loop's masks, mixtures of experts through batched_mm, models whose attention is not causal or
that keep no transformers cache, and tensors of Python numbers made on the device in a capture
(their mode, checked on the CPU)."""

import pytest
import torch

from graphwrap import GraphedModule
from graphwrap.capture.constants import HostConstants, plain_numbers, with_constants
from graphwrap.loops import experts as experts_mod
from graphwrap.loops.window import is_ring, ring_layer, ring_unsupported

tr = pytest.importorskip("transformers", reason="needs transformers, which no extra installs: pip install transformers")

SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, pad_token_id=0)


def _model(config, model, attention="sdpa", **kw):
    if not hasattr(tr, model):
        pytest.skip(f"this transformers has no {model}")
    torch.manual_seed(0)
    m = getattr(tr, model)(getattr(tr, config)(**kw)).eval()
    try:
        m.set_attn_implementation(attention)
    except ValueError as e:  # an attention this transformers does not offer for the model
        pytest.skip(f"this transformers: {str(e).splitlines()[0][:100]}")
    return m


def _left_padded(rows=2, prompt=6, pad=3):
    ids = torch.randint(1, 100, (rows, prompt))
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    ids[0, :pad] = 0
    return dict(input_ids=ids, attention_mask=mask)


def _steps_to_engine(gm) -> int:
    """Calls the engine ran (eagerly, on a CPU): the decode steps handed to graphwrap."""
    return sum(gm.stats()["eager_calls"].values())


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", [("MistralConfig", "MistralForCausalLM"), ("Gemma2Config", "Gemma2ForCausalLM"),
                                    ("Gemma3TextConfig", "Gemma3ForCausalLM"), ("Cohere2Config", "Cohere2ForCausalLM")])
def test_a_window_of_8_gives_generates_tokens_40_tokens_past_it(family, attention):
    """All sliding (Mistral, Gemma 3's small default) and sliding beside full attention (Gemma 2,
    Cohere 2): prompts shorter and longer than the window, left-padded; every step goes to the
    engine with the loop's masks over ring layers."""
    model = _model(*family, attention=attention, **SMALL, sliding_window=8)
    gm = GraphedModule(model, decode=False)
    for prompt in (6, 13):
        kw = dict(_left_padded(prompt=prompt), max_new_tokens=40, min_new_tokens=40, do_sample=False)
        with torch.no_grad():
            want = model.generate(**kw)
            got = gm.generate(**kw, cache_implementation="static")
        assert torch.equal(got, want)
    (cache,) = gm.__dict__["_gw_caches"].values()
    assert any(is_ring(layer) for layer in cache.layers)
    assert not any(getattr(layer, "ring_masks", False) for layer in cache.layers)  # put back after each call
    assert gm.stats()["generate"] == {"graphwrap's decode loop": 2}
    assert _steps_to_engine(gm) == 2 * 39


def test_a_ring_without_the_loops_masks_gives_the_models_logits():
    """Driven as transformers drives a cache (its own masks, the prompt then one token at a time),
    a ring returns its window in position order: the logits are those of transformers' cache."""
    model = _model("MistralConfig", "MistralForCausalLM", **SMALL, sliding_window=8)
    ring = tr.StaticCache(config=model.config, max_cache_len=64)
    ring.layers = [ring_layer(64, 8) for _ in ring.layers]
    plain = tr.DynamicCache(config=model.config)
    ids = torch.randint(1, 100, (2, 11))
    with torch.no_grad():
        a = model(input_ids=ids, past_key_values=ring, use_cache=True).logits
        b = model(input_ids=ids, past_key_values=plain, use_cache=True).logits
        torch.testing.assert_close(a, b)
        for i in range(12):
            tok = torch.randint(1, 100, (2, 1))
            pos = torch.full((2, 1), 11 + i)
            a = model(input_ids=tok, past_key_values=ring, position_ids=pos, use_cache=True).logits
            b = model(input_ids=tok, past_key_values=plain, position_ids=pos, use_cache=True).logits
            torch.testing.assert_close(a, b)


def test_a_request_transformers_loop_serves_gets_no_ring():
    """Beam search runs transformers' loop, which builds its own masks: the cache it gets has
    transformers' own window layers, and its tokens are model.generate's."""
    model = _model("MistralConfig", "MistralForCausalLM", **SMALL, sliding_window=8)
    gm = GraphedModule(model, decode=False)
    kw = dict(_left_padded(), max_new_tokens=20, do_sample=False, num_beams=2)
    with torch.no_grad():
        want = model.generate(**kw)
        got = gm.generate(**kw, cache_implementation="static")
    assert torch.equal(got, want)
    assert not any(is_ring(layer) for c in gm.__dict__.get("_gw_caches", {}).values() for layer in c.layers)


def test_rings_serve_sdpa_and_eager_attention_only():
    model = _model("MistralConfig", "MistralForCausalLM", **SMALL, sliding_window=8)
    assert ring_unsupported(model) is None
    object.__setattr__(model.config, "_attn_implementation_internal", "flex_attention")
    assert "flex_attention" in ring_unsupported(model)
    assert ring_unsupported(_model("LlamaConfig", "LlamaForCausalLM", **SMALL)) is None  # no window: nothing to do


@pytest.mark.parametrize("family", [
    ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                   shared_expert_intermediate_size=64)),
])
def test_experts_run_batched_mm_in_decode_steps_only(family, monkeypatch):
    config, cls, kw = family
    model = _model(config, cls, **SMALL, **kw)
    if not experts_mod.experts_configs(model):
        pytest.skip("this transformers has no experts interface")
    before = model.config._experts_implementation
    seen = []
    real = experts_mod.batched_experts.__enter__

    def enter(self):
        out = real(self)
        seen.append(model.config._experts_implementation)
        return out
    monkeypatch.setattr(experts_mod.batched_experts, "__enter__", enter)
    gm = GraphedModule(model, decode=False)
    kw = dict(_left_padded(), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    with torch.no_grad():
        want = model.generate(**kw)
        got = gm.generate(**kw, cache_implementation="static")
    assert torch.equal(got, want)
    assert seen == ["batched_mm"] * 19  # each decode step, not the prompt's forward
    assert model.config._experts_implementation == before


def test_a_user_chosen_experts_implementation_is_left_alone():
    model = _model("MixtralConfig", "MixtralForCausalLM", **SMALL, num_local_experts=4, num_experts_per_tok=2)
    if not experts_mod.experts_configs(model):
        pytest.skip("this transformers has no experts interface")
    object.__setattr__(model.config, experts_mod.FIELD, "custom")
    with experts_mod.batched_experts(model):
        assert model.config._experts_implementation == "custom"


def test_a_model_whose_attention_is_not_causal_gets_its_own_tokens():
    """BERT's LM head without is_decoder attends both ways over what the cache holds: the 2D
    mask the loop keeps covers written positions only (it was extended with ones, and the empty
    slots of the static cache were read: the tokens differed)."""
    model = _model("BertConfig", "BertLMHeadModel", vocab_size=100, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, intermediate_size=128, pad_token_id=0)
    gm = GraphedModule(model, decode=False)
    kw = dict(_left_padded(), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    with torch.no_grad():
        assert torch.equal(gm.generate(**kw, cache_implementation="static"), model.generate(**kw))


@pytest.mark.parametrize("family", [("OpenAIGPTConfig", "OpenAIGPTLMHeadModel", dict(n_embd=64, n_layer=2, n_head=4)),
                                    ("XLNetConfig", "XLNetLMHeadModel", dict(d_model=64, n_layer=2, n_head=4,
                                                                             d_inner=128))])
def test_a_model_without_a_transformers_cache_is_generated_as_transformers_does(family):
    """No cache argument in its forward (GPT), or a cache of its own (XLNet): graphwrap passes no
    static cache (it did, and generate refused the call)."""
    config, cls, kw = family
    model = _model(config, cls, vocab_size=100, **kw)
    gm = GraphedModule(model, decode=False)
    ids = torch.randint(1, 100, (2, 6))
    kw = dict(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with torch.no_grad():
        assert torch.equal(gm.generate(**kw, cache_implementation="static"), model.generate(**kw))


# -------------------------------------------------------------- tensors of Python numbers

def test_python_numbers_are_made_on_the_device_with_the_same_values():
    kept = []
    x = torch.arange(12.0).reshape(3, 4)
    with HostConstants(kept, device_type="cpu", pin=False):
        scalar = torch.tensor(0.5, device="cpu")
        same = torch.tensor([2, 2, 2], device="cpu")
        listed = torch.as_tensor([[1.0, 2.0], [3.0, 4.0]], device="cpu")
        picked = x[..., [3, 0]]
        rows = x[[2, 0]]
        masked = x[[True, False, True]]  # a list of bools indexes as a mask: left as it is
        y = x.clone()
        y[..., [0, 1]] = 7.0
    assert scalar.dtype == torch.float32 and float(scalar) == 0.5
    assert torch.equal(same, torch.tensor([2, 2, 2])) and same.dtype == torch.long
    assert torch.equal(listed, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert torch.equal(picked, x[:, [3, 0]]) and torch.equal(rows, x[[2, 0]]) and torch.equal(masked, x[[0, 2]])
    assert torch.equal(y[:, :2], torch.full((3, 2), 7.0)) and torch.equal(y[:, 2:], x[:, 2:])
    # one value is filled by a kernel; several are copied from a kept buffer (listed, the index lists)
    assert len(kept) == 4 and all(not k.is_inference() for k in kept)


def test_tensors_and_data_of_other_kinds_are_left_to_the_function():
    """A CPU tensor (an input, a buffer) is not a constant: made as the function makes it."""
    kept = []
    src = torch.tensor([1.0, 2.0])
    with HostConstants(kept, device_type="cpu", pin=False):
        t = torch.as_tensor(src, device="cpu")
        torch.tensor([1, 2])  # no device: made where the function makes it
    assert t is src and kept == []
    assert plain_numbers([[1, 2.5], (True, 3)]) and not plain_numbers([1, "a"]) and not plain_numbers(list(range(5000)))


def test_arange_from_a_position_on_the_device_reads_nothing_back():
    """``torch.arange(past, past + n)`` with ``past`` a 0-d tensor on the device: eager reads both
    bounds back (on a meta tensor, which holds no values, that raises); inside the mode the same
    values come from ``past + arange(n)``, read nowhere. Other bounds are left as they are."""
    past = torch.tensor(5, device="meta")
    with pytest.raises(RuntimeError):
        torch.arange(past, past + 3)
    with HostConstants([], device_type="meta", pin=False):
        made = [torch.arange(past, past + 3, dtype=torch.long, device="meta"), torch.arange(past, 3 + past)]
    assert [(t.shape, t.dtype) for t in made] == [((3,), torch.long)] * 2
    at = torch.tensor(5)
    with HostConstants([], device_type="cpu", pin=False):
        got = [torch.arange(at, at + 3, dtype=torch.float32), torch.arange(at, at + 0), torch.arange(at, at + 2),
               torch.arange(torch.tensor(1), at + 2)]  # not at's own sum: the function's own
    assert torch.equal(got[0], torch.tensor([5.0, 6.0, 7.0])) and got[1].numel() == 0
    assert torch.equal(got[2], torch.tensor([5, 6])) and torch.equal(got[3], torch.arange(1, 7))


def test_with_constants_runs_as_it_is_outside_a_capture():
    calls = []
    run = with_constants(lambda: calls.append(torch.tensor([1.0, 2.0])) or 7)
    assert run() == 7 and run.kept == [] and len(calls) == 1


def test_a_cache_with_recurrent_layers_runs_eagerly_with_the_reason():
    """NemotronH (Mamba layers beside attention): its replayed steps gave other tokens than eager
    on an H100, so a cache with recurrent layers is not graphed; generate's tokens, the reason."""
    from helpers import on_cpu_graphs, replays

    if not hasattr(tr, "NemotronHForCausalLM"):
        pytest.skip("this transformers has no NemotronH")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import families

    try:
        model = families.build("nemotron_h", "causal", "NemotronHForCausalLM", "cpu")
    except Exception as e:  # noqa: BLE001 - this transformers' config does not make it small
        pytest.skip(f"NemotronH is not built from a small config here: {type(e).__name__}: {e}")
    try:
        tr.StaticCache(config=model.config, max_cache_len=8)
    except Exception as e:  # noqa: BLE001 - transformers 5.14 makes no static cache of it
        pytest.skip(f"this transformers makes no static cache of NemotronH: {type(e).__name__}: {e}")
    gm = on_cpu_graphs(GraphedModule(model, decode=False, eager_if_faster=False))
    kw = dict(families.inputs(model, "causal", "cpu"), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with torch.no_grad():
        assert torch.equal(gm.generate(**kw, cache_implementation="static"), model.generate(**kw))
    assert replays(gm) == 0 and any("recurrent" in r for r in gm.stats()["eager_calls"])
