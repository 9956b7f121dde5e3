"""Prefix caching in the shared batch on a GPU (``decode={"prefix_caching": True}``): steps,
pieces and mixed steps replay their graphs over rows whose first blocks are another request's
cached blocks; greedy tokens against model.generate alone (fp32, TF32 off: equal) for shared
system prompts (prefilled whole and in pieces), a conversation's turns, evicted and reused
blocks, preemption, a sliding-window model, one prompt 64 times at once, and seeded sampling
against caching off."""

import pytest
import torch
from helpers import thread_results
from test_generate_paged_cuda import _check, _fixed_pool, _model, _replayed

from graphwrap import GraphedModule
from graphwrap.decoding.cache.pool import BLOCK
from graphwrap.decoding.engine import server as server_mod

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fp32_exact")]
DEV = "cuda"
tr = pytest.importorskip("transformers", reason="needs transformers, which no extra installs: pip install transformers")
ON = {"prefix_caching": True}


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 1000, (n,), generator=g).tolist()


def _at_once(gm, prompts, news):
    return thread_results(lambda i: gm.generate(input_ids=torch.tensor([prompts[i]], device=DEV),
                                                max_new_tokens=news[i], do_sample=False), len(prompts))


def _reqs(prompts, news):
    return [(torch.tensor([p], device=DEV), n) for p, n in zip(prompts, news)]


def _hits(gm):
    return gm.stats()["decode"]["prefix_cache"]["prefix_cache_hits"]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("system_len", [40, 300], ids=["prefilled-whole", "in-pieces"])
def test_shared_system_prompts_replay_over_cached_blocks_and_give_generates_tokens(monkeypatch, kind, system_len):
    monkeypatch.setattr(server_mod, "CHUNK", 64)  # (300 tokens: pieces, inside decoding rows' steps too)
    model = _model(kind)
    gm = GraphedModule(model, decode=ON)
    systems = [_ids(system_len, s) for s in (1, 2)]
    for rnd in range(2):  # the second round replays what the first captured, every prefix cached
        prompts = [systems[i % 2] + _ids(3 + 5 * i, 10 * rnd + i) for i in range(12)]
        news = [6 + 3 * i for i in range(12)]
        _check(model, _reqs(prompts, news), _at_once(gm, prompts, news))
    d = gm.stats()["decode"]
    # (short prompts at once are prefilled together, the first of a turn's alone taking the cache)
    assert _hits(gm) >= (12 if system_len > 64 else 1) * (system_len // BLOCK) * BLOCK, d["prefix_cache"]
    assert d["cache"] == "paged" and d["cache_blocks"]["used"] == 0
    _replayed(d)
    gm.close()


def test_a_conversations_turns_with_graphs_captured_ahead(monkeypatch):
    monkeypatch.setattr(server_mod, "CHUNK", 32)
    model = _model()
    gm = GraphedModule(model, decode=ON)
    assert gm.capture_generate(timeout=300)
    histories = [_ids(20 + 7 * c, 50 + c) for c in range(6)]
    for turn in range(4):
        news = [8] * len(histories)
        got = _at_once(gm, histories, news)
        _check(model, _reqs(histories, news), got)
        histories = [o[0].tolist() + _ids(5, 100 * turn + c) for c, o in enumerate(got)]
    d = gm.stats()["decode"]
    assert _hits(gm) >= 3 * 6 * BLOCK and d["capture_failed"] == {}
    assert d["eager_forwards"].get("piece", 0) == 0, "every piece served by a graph"
    gm.close()


def test_evicted_blocks_are_reused_and_preempted_rows_resume_from_cached_blocks(monkeypatch):
    _fixed_pool(monkeypatch, 24)  # 24 blocks of 16: a few prompts' worth
    model = _model()
    gm = GraphedModule(model, decode=ON)
    system = _ids(40, 7)
    prompts = [system + _ids(n, 20 + n) for n in (3, 9, 14, 6, 11, 2)]
    news = [90, 70, 100, 60, 80, 95]  # (six rows of up to 8 blocks, 2 shared, outgrow 24)
    for rnd in range(2):
        _check(model, _reqs(prompts, news), _at_once(gm, prompts, news))
        others = [_ids(70 + 9 * i, 300 + 10 * rnd + i) for i in range(4)]  # (pushes the system prompt out)
        _check(model, _reqs(others, [5] * 4), _at_once(gm, others, [5] * 4))
    d = gm.stats()["decode"]
    assert d["preempted"] > 0 and d["cache_blocks"]["used"] == 0 and d["cache_blocks"]["free"] == 24, d
    assert 0 < d["prefix_cache"]["blocks"] <= 24 and _hits(gm) > 0
    _replayed(d)
    gm.close()


def test_one_prompt_64_times_at_once_and_a_sliding_window_model(monkeypatch):
    monkeypatch.setattr(server_mod, "CHUNK", 16)
    model = _model()
    gm = GraphedModule(model, decode=ON)
    same = _ids(50, 3)
    for _ in range(2):
        got = _at_once(gm, [same] * 64, [10] * 64)
        _check(model, _reqs([same] * 64, [10] * 64), got)
    assert _hits(gm) >= 64 * 48
    gm.close()
    torch.manual_seed(0)
    cfg = tr.MistralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512, sliding_window=24,
                           bos_token_id=1, eos_token_id=None, pad_token_id=0)
    windowed = tr.AutoModelForCausalLM.from_config(cfg).to(DEV).eval()
    gm = GraphedModule(windowed, decode=ON)
    system = _ids(70, 4)
    for rnd in range(2):
        prompts = [system + _ids(4 + i, 40 + 10 * rnd + i) for i in range(8)]
        _check(windowed, _reqs(prompts, [30] * 8), _at_once(gm, prompts, [30] * 8))
    assert _hits(gm) > 0
    _replayed(gm.stats()["decode"])
    gm.close()


def test_seeded_sampling_draws_caching_offs_tokens():
    model = _model()
    prompt = torch.tensor([_ids(45, 9)], device=DEV)
    kw = dict(max_new_tokens=20, do_sample=True, top_k=20, temperature=0.9)
    off = GraphedModule(model)
    on = GraphedModule(model, decode=ON)
    on.generate(prompt, max_new_tokens=1, do_sample=False)  # (its blocks cached)
    for seed in range(3):
        torch.manual_seed(seed)
        want = off.generate(prompt, **kw)
        torch.manual_seed(seed)
        assert torch.equal(on.generate(prompt, **kw), want), seed
    assert _hits(on) >= 3 * 32
    off.close()
    on.close()
