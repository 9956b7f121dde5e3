"""The decode step's grouped-query attention without repeated keys (graphwrap/decoding/kernels/attention.py):
equal to transformers' sdpa where it folds, sdpa itself where it does not, set and restored on
the model only around the batch's own calls, and used by the shared batch of a Llama whose
tokens stay model.generate's. Needs transformers (skipped with the reason without it)."""

import pytest
import torch
from helpers import thread_results

from graphwrap import GraphedModule
from graphwrap.decoding.kernels import attention

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402


class _Attn(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups


def _qkv(b, hkv, groups, q, k, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hkv * groups, q, d, generator=g), torch.randn(b, hkv, k, d, generator=g),
            torch.randn(b, hkv, k, d, generator=g))


def _row_mask(b, k, seed=1):
    lengths = torch.randint(1, k + 1, (b,), generator=torch.Generator().manual_seed(seed))
    seen = torch.arange(k)[None, :] < lengths[:, None]
    return torch.where(seen, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]


@pytest.mark.parametrize("groups,hkv", [(2, 2), (4, 1), (8, 4)])
def test_folded_attention_equals_sdpa_for_one_query_position_per_row(groups, hkv):
    q, k, v = _qkv(5, hkv, groups, 1, 19)
    mask = _row_mask(5, 19)
    got, _ = attention.folded_sdpa(_Attn(groups), q, k, v, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(_Attn(groups), q, k, v, mask, scaling=0.3)
    assert got.shape == want.shape == (5, 1, hkv * groups, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups,hkv,b,mask_rows", [(4, 2, 1, 1), (2, 3, 3, 3), (8, 1, 2, 1)])
def test_folded_attention_equals_sdpa_for_many_query_positions_under_their_own_mask_rows(groups, hkv, b, mask_rows):
    """A piece of a prompt (or joined prompts): each query position its own row of the mask,
    one mask for every row (mask_rows 1) or a mask per row."""
    n, k = 6, 23
    q, key, v = _qkv(b, hkv, groups, n, k, seed=3)
    start = torch.tensor([17, 4, 0])[:mask_rows]  # (causal within the piece, after its start)
    seen = torch.arange(k)[None, None, :] <= (start[:, None, None] + torch.arange(n)[None, :, None])
    mask = torch.where(seen, 0.0, torch.finfo(torch.float32).min)[:, None]
    got, _ = attention.folded_sdpa(_Attn(groups), q, key, v, mask, scaling=0.2)
    want, _ = sdpa_attention_forward(_Attn(groups), q, key, v, mask, scaling=0.2)
    assert got.shape == want.shape == (b, n, hkv * groups, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    bool_mask = seen[:, None]  # (transformers' own masks are boolean)
    torch.testing.assert_close(attention.folded_sdpa(_Attn(groups), q, key, v, bool_mask)[0],
                               sdpa_attention_forward(_Attn(groups), q, key, v, bool_mask)[0], rtol=1e-5, atol=1e-5)


def test_it_folds_one_query_position_and_leaves_everything_else_to_sdpa(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa_module

    handed = []
    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward",
                        lambda *a, **kw: handed.append(a[1].shape) or sdpa_attention_forward(*a, **kw))
    q, k, v = _qkv(3, 2, 4, 1, 7)
    attention.folded_sdpa(_Attn(4), q, k, v, _row_mask(3, 7))
    q5, k5, v5 = _qkv(3, 2, 4, 5, 7)
    attention.folded_sdpa(_Attn(4), q5, k5, v5, torch.zeros(3, 1, 5, 7))
    assert handed == [], "one query position per row, or a row of the mask per query position: folded"
    # Not folded (transformers' sdpa itself): one mask row for many query positions, a mask per
    # head, no groups, more query positions than 2 x key heads x head width (the repeated mask
    # would outweigh the keys it spares: 2 x 2 x 8 = 32 here).
    q33, k33, v33 = _qkv(1, 2, 4, 33, 40)
    cases = ((_Attn(4), q5, k5, v5, torch.zeros(3, 1, 1, 7)), (_Attn(4), q, k, v, torch.zeros(3, 8, 1, 7)),
             (_Attn(1), *_qkv(3, 8, 1, 1, 7), _row_mask(3, 7)), (_Attn(4), q33, k33, v33, torch.zeros(1, 1, 33, 40)))
    for args in cases:
        got, _ = attention.folded_sdpa(*args)
        torch.testing.assert_close(got, sdpa_attention_forward(*args)[0])
    assert [tuple(s) for s in handed] == [(3, 8, 5, 8), (3, 8, 1, 8), (3, 8, 1, 8), (1, 8, 33, 8)]
    q32, k32, v32 = _qkv(1, 2, 4, 32, 40)
    attention.folded_sdpa(_Attn(4), q32, k32, v32, torch.zeros(1, 1, 32, 40))
    assert len(handed) == 4, "32 positions: folded"


def _spy_sdpa(monkeypatch):
    """The calls of torch's attention from graphwrap's function: each call's keyword arguments."""
    import types

    calls = []

    def spy(*a, **kw):
        calls.append(kw)
        return torch.nn.functional.scaled_dot_product_attention(*a, **kw)

    monkeypatch.setattr(attention, "F", types.SimpleNamespace(scaled_dot_product_attention=spy))
    return calls


@pytest.mark.parametrize("groups,hkv", [(4, 2), (1, 3)])
def test_joined_prompts_take_causal_attention_and_give_the_masks_answer_at_their_own_positions(monkeypatch, groups,
                                                                                              hkv):
    from graphwrap.decoding.engine.step import prompt_mask

    calls = _spy_sdpa(monkeypatch)
    lengths = torch.tensor([5, 8, 1, 3])
    mask = prompt_mask(lengths, 8, torch.float32)
    assert mask._gw_causal, "a windowless prompts' mask is marked"
    q, k, v = _qkv(4, hkv, groups, 8, 8, seed=4)
    got, _ = attention.folded_sdpa(_Attn(groups), q, k, v, mask, scaling=0.25)
    assert len(calls) == 1 and calls[0]["is_causal"] and "attn_mask" not in calls[0]
    want, _ = sdpa_attention_forward(_Attn(groups), q, k, v, mask.clone(), scaling=0.25)  # (clone: unmarked)
    assert got.shape == want.shape == (4, 8, hkv * groups, 8)
    for i, n in enumerate(lengths.tolist()):  # (a padded position's output is never read)
        torch.testing.assert_close(got[i, :n], want[i, :n], rtol=1e-5, atol=1e-5)


def test_masks_that_causal_alone_would_not_answer_keep_the_masked_path(monkeypatch):
    """A sliding window's mask is not marked; a marked mask under a soft cap or a window
    argument, or keys past the prompts' own positions, or a view of the mask (the mark not
    carried), goes the way it went before the mark, and so would one with a position bias."""
    from graphwrap.decoding.engine.step import prompt_mask

    lengths = torch.tensor([6, 2])
    assert not getattr(prompt_mask(lengths, 6, torch.float32, window=3), "_gw_causal", False)
    calls = _spy_sdpa(monkeypatch)
    mask = prompt_mask(lengths, 6, torch.float32)
    q, k, v = _qkv(2, 2, 4, 6, 6, seed=5)
    for kw in (dict(softcap=30.0), dict(sliding_window=3)):
        got, _ = attention.folded_sdpa(_Attn(4), q, k, v, mask, **kw)
        torch.testing.assert_close(got, attention.folded_sdpa(_Attn(4), q, k, v, mask.clone(), **kw)[0])
    # (a position bias comes with transformers' boolean masks, which prompt_mask never makes)
    assert not attention._causal(_Attn(4), q, k, torch.zeros(2, 8, 6, 6), {})
    assert attention._causal(_Attn(4), q, k, None, {})
    longer = torch.zeros(2, 1, 6, 9)
    longer._gw_causal = True
    attention.folded_sdpa(_Attn(4), *_qkv(2, 2, 4, 6, 9, seed=6), longer)
    attention.folded_sdpa(_Attn(4), q, k, v, mask[:, :, :, :6])
    assert not any(c.get("is_causal") for c in calls)


def _llama(heads=4, kv=2):
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv, vocab_size=101, max_position_embeddings=128, bos_token_id=1,
                         pad_token_id=0)
    return tr.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def test_folding_is_set_only_inside_the_block_and_only_for_grouped_sdpa_models(monkeypatch):
    monkeypatch.setattr(attention, "sdpa_folds", lambda: False)  # as on transformers before 5.24
    model = _llama()
    assert attention.grouped(model)
    with attention.folding(model):
        assert model.config._attn_implementation == attention.NAME
    assert model.config._attn_implementation == "sdpa"
    assert not attention.grouped(_llama(kv=4)), "no groups: nothing to fold"
    eager = tr.AutoModelForCausalLM.from_config(_llama().config, attn_implementation="eager").eval()
    assert not attention.grouped(eager)
    with attention.folding(eager):
        assert eager.config._attn_implementation == "eager"
    # The model's own forward, with the fold set, gives sdpa's logits.
    ids = torch.randint(2, 101, (2, 6))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with attention.folding(model):
            got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("own", [False, True], ids=["graphwraps_fold", "transformers_own_if_it_has_one"])
def test_a_grouped_llamas_shared_batch_folds_its_steps_and_keeps_generates_tokens(monkeypatch, own):
    if not own:
        monkeypatch.setattr(attention, "sdpa_folds", lambda: False)  # as on transformers before 5.24
    model = _llama(heads=8, kv=2)
    folds = []
    real = attention._folds
    monkeypatch.setattr(attention, "_folds", lambda *a: folds.append(1) or True if real(*a) else False)
    gm = GraphedModule(model)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 101, (n,), generator=g).tolist() for n in (4, 9, 2, 12)]
    got = thread_results(lambda i: gm.generate(torch.tensor([prompts[i]]), max_new_tokens=6 + i, do_sample=False), 4)
    for i, (p, out) in enumerate(zip(prompts, got)):
        with torch.no_grad():
            want = model.generate(input_ids=torch.tensor([p]), max_new_tokens=6 + i, do_sample=False)
        assert torch.equal(out, want)
    assert gm.stats()["generate"] == {"graphwrap's shared decode batch": 4}
    assert bool(folds) == (not attention.sdpa_folds()), "graphwrap's fold runs where transformers has none"
    assert model.config._attn_implementation == "sdpa"
    gm.close()


def test_the_models_own_generate_on_another_thread_keeps_its_tokens_while_the_batch_folds(monkeypatch):
    monkeypatch.setattr(attention, "sdpa_folds", lambda: False)  # as on transformers before 5.24
    model = _llama(heads=8, kv=2)
    g = torch.Generator().manual_seed(5)
    mine = torch.randint(2, 101, (2, 7), generator=g)
    with torch.no_grad():
        want = model.generate(input_ids=mine, attention_mask=torch.ones_like(mine), max_new_tokens=8,
                              do_sample=False)
    gm = GraphedModule(model)
    prompts = [torch.randint(2, 101, (n,), generator=g).tolist() for n in (4, 9, 2, 12, 5, 3)]

    def work(i):
        if i == 0:  # the user's own eager generate, again and again, beside the batch's steps
            with torch.no_grad():
                return [model.generate(input_ids=mine, attention_mask=torch.ones_like(mine), max_new_tokens=8,
                                       do_sample=False) for _ in range(15)]
        return [gm.generate(torch.tensor([prompts[(i + j) % 6]]), max_new_tokens=12, do_sample=False)
                for j in range(3)]

    got = thread_results(work, 4)
    assert all(torch.equal(out, want) for out in got[0])
    assert model.config._attn_implementation == "sdpa"
    gm.close()


# ------------------------------------------------------------------ without_cudnn

def test_without_cudnn_turns_the_switch_off_inside_and_puts_it_back_after_the_last_block():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with attention.without_cudnn(cpu):
        assert torch.backends.cuda.cudnn_sdp_enabled(), "a CPU's forwards leave the switch alone"
    outer = attention.without_cudnn(cuda)
    with outer:
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        inner = attention.without_cudnn(cuda)  # (the decode thread and the capturing thread, say)
        inner.__enter__()
        outer.__exit__(None, None, None)
        assert not torch.backends.cuda.cudnn_sdp_enabled(), "another block is still inside"
        inner.__exit__(None, None, None)
        assert torch.backends.cuda.cudnn_sdp_enabled()
        outer.__enter__()  # (for the with's own exit)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_without_cudnn_leaves_a_switch_the_user_turned_off_off():
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        with attention.without_cudnn(torch.device("cuda")):
            assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def test_without_cudnn_from_many_threads_ends_as_it_began():
    def one(i):
        for _ in range(200):
            with attention.without_cudnn(torch.device("cuda")):
                assert not torch.backends.cuda.cudnn_sdp_enabled()
        return i

    assert thread_results(one, 8) == list(range(8))
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_without_cudnn_puts_the_switch_back_when_its_block_raises():
    with pytest.raises(RuntimeError, match="a forward failed"):
        with attention.without_cudnn(torch.device("cuda")):
            raise RuntimeError("a forward failed")
    assert torch.backends.cuda.cudnn_sdp_enabled()
