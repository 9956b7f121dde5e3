"""The shared batch reading its paged pool in place, on a CPU: what a GPU does with graphwrap's
attention kernels (each row read to its own length, no mask), here with the kernels' torch
references, which the operators run off a GPU. Tokens against ``model.generate`` alone, and what
a step hands the model and the attention. Needs transformers (skipped with the reason without it)."""

import pytest
import torch
from helpers import thread_results

from graphwrap import GraphedModule
from graphwrap.decoding import paged_attention
from graphwrap.decoding import server as server_mod
from graphwrap.decoding.attention import sdpa_model

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
SHARED = "graphwrap's shared decode batch"


@pytest.fixture
def in_place(monkeypatch):
    """The batch reads its pool in place as on a GPU (where the model's attention is sdpa), and
    prompts past 8 positions go in pieces."""
    monkeypatch.setattr(server_mod, "reads_in_place", lambda model, device: sdpa_model(model))
    monkeypatch.setattr(server_mod, "CHUNK", 8)


def _model(kind):
    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=101, max_position_embeddings=256, bos_token_id=1, eos_token_id=None,
                 pad_token_id=0)
    if kind == "gpt2":
        cfg = tr.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=256, bos_token_id=1,
                            eos_token_id=None, pad_token_id=0)
    elif kind == "llama":
        cfg = tr.LlamaConfig(**shape)
    elif kind == "mistral":
        cfg = tr.MistralConfig(**shape, sliding_window=4)
    else:  # layers with and without the window, scores capped (Gemma 2)
        cfg = tr.Gemma2Config(**shape, sliding_window=4, head_dim=16, attn_logit_softcapping=5.0,
                              final_logit_softcapping=None)
    return tr.AutoModelForCausalLM.from_config(cfg).eval()


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 101, (n,), generator=g).tolist() for n in lengths]


def _alone(model, prompt, n):
    with torch.no_grad():
        return model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=n)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mistral", "gemma2"])
def test_steps_read_in_place_give_generates_tokens(in_place, kind):
    model = _model(kind)
    gm = GraphedModule(model)
    prompts = _prompts([3, 11, 6, 20, 2, 9])
    news = [25, 10, 30, 12, 40, 18]
    got = thread_results(lambda i: gm.generate(torch.tensor([prompts[i]]), max_new_tokens=news[i]), len(prompts))
    for p, n, out in zip(prompts, news, got):
        assert torch.equal(out, _alone(model, p, n))
    server = gm.__dict__["_gw_decode"]
    # (read in place where the model's attention is sdpa: transformers 5.24 makes Gemma 2's eager)
    assert server.store.kernel == sdpa_model(model) and (server.store.kernel or kind == "gemma2")
    st = gm.stats()
    assert st["generate"] == {SHARED: len(prompts)}, st["decode"].get("off")
    assert st["decode"]["prefill_pieces"] > 0
    gm.close()


def test_a_step_read_in_place_hands_the_model_a_mask_of_one_position_and_finds_lengths_once(in_place, monkeypatch):
    model = _model("llama")
    masks, seen = [], []
    forward = model.forward

    def watched(*args, **kwargs):
        if kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] == 1:
            masks.append(kwargs.get("attention_mask"))
        return forward(*args, **kwargs)

    model.forward = watched
    attend = paged_attention.attend

    def attend_seen(query, k_pool, v_pool, table, lengths, *args):
        seen.append(lengths)
        return attend(query, k_pool, v_pool, table, lengths, *args)

    monkeypatch.setattr(paged_attention, "attend", attend_seen)
    gm = GraphedModule(model)
    prompt = _prompts([5])[0]
    out = gm.generate(torch.tensor([prompt]), max_new_tokens=6)
    model.forward = forward
    assert torch.equal(out, _alone(model, prompt, 6))
    steps = [m for m in masks if isinstance(m, torch.Tensor)]
    assert steps and all(m.dim() == 4 and m.shape[-1] == 1 for m in steps), [tuple(m.shape) for m in steps]
    # Each forward's layers (two) are handed the one tensor its first layer made.
    assert seen and len(seen) % 2 == 0
    assert all(a is b for a, b in zip(seen[::2], seen[1::2]))
    assert all(a is not b for a, b in zip(seen[::2], seen[2::2]))
    gm.close()


def test_a_step_that_gathers_still_hands_the_model_its_whole_window():
    from graphwrap.decoding.pages import PagedStore

    store = PagedStore(4, 64, "cpu", 16, 20)
    store.allocate([torch.zeros(1, 2, 1, 8)], [torch.zeros(1, 2, 1, 8)])
    window = store.window(32)
    assert not window.in_place and window.span == 32
    store.direct = True
    assert window.in_place, "the base store's switch, as folding sets it"
    twin = store.twin()
    assert twin.window(32).in_place, "a capture's twin reads the base store's switch"
