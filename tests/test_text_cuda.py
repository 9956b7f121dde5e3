"""Inputs of every length on a GPU: graphs over batch x sequence buckets, padding verified, requests
of different lengths joined. Every answer is compared with eager at the real length."""

import asyncio
import random

import pytest
import torch
from helpers import eager_answer, small_bert
from torch import nn

from graphwrap import Batcher, GraphedModule

pytestmark = pytest.mark.cuda
DEV = "cuda"


def _text(n, L, vocab, pad_tail=0, g=None):
    ids = torch.randint(1, vocab, (n, L), device=DEV, generator=g)
    mask = torch.ones(n, L, dtype=torch.long, device=DEV)
    if pad_tail and L > pad_tail:
        mask[:, L - pad_tail:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _close(got, want, tol=2e-3):
    for name in ("last_hidden_state", "pooler_output", "logits"):
        if name in want:
            torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol)


def test_small_bert_every_length_1_to_300_against_eager_at_the_real_length():
    tr = pytest.importorskip("transformers")
    model, cfg = small_bert(tr, DEV)
    gm = GraphedModule(model, seq_dim=1, max_batch_size=8)
    rng = random.Random(0)
    for L in range(1, 301):
        n = rng.randint(1, 8)
        inputs = _text(n, L, cfg.vocab_size, pad_tail=L // 4 if L % 2 else 0)
        got = gm(**inputs)
        want = eager_answer(model, **inputs)
        assert got.last_hidden_state.shape == (n, L, cfg.hidden_size)
        _close(got, want)
    s = gm.stats()
    k = s["keys"][0]
    print(f"\nsmall BERT, lengths 1..300: {len(k['buckets'])} buckets, padded tokens {s['padded_token_share']:.1%}")
    assert s["eager_calls"] == {} and k["lengths"] == "padded" and len(s["keys"]) == 1
    assert 0 < s["padded_token_share"] < 0.5


class MeanPooled(nn.Module):
    """Averages over every position, padded or not: must never be padded along the sequence."""

    def __init__(self, vocab=100, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lin = nn.Linear(d, d)

    def forward(self, input_ids, attention_mask):
        return self.lin(self.emb(input_ids).mean(1))


def test_a_model_that_averages_over_every_position_is_served_at_exact_lengths(gw_log):
    model = MeanPooled().to(DEV).eval()
    gm = GraphedModule(model, seq_dim=1)
    for L in (5, 9, 5, 30, 9):
        inputs = _text(3, L, 100)
        torch.testing.assert_close(gm(**inputs), eager_answer(model, **inputs), rtol=1e-5, atol=1e-5)
    k = gm.stats()["keys"][0]
    assert k["lengths"].startswith("exact") and "does not ignore padded positions" in k["lengths"]
    assert {b["seq"] for b in k["buckets"].values() if b["captured"]} == {5, 9, 30}
    assert any("are not padded" in r.getMessage() for r in gw_log.records)


def test_lengths_past_the_largest_bucket_run_eagerly_with_the_reason():
    tr = pytest.importorskip("transformers")
    model, cfg = small_bert(tr, DEV)
    gm = GraphedModule(model, seq_dim=1, seq_buckets=[16, 32])
    for L in (10, 40, 32):
        inputs = _text(2, L, cfg.vocab_size)
        _close(gm(**inputs), eager_answer(model, **inputs))
    reasons = gm.stats()["eager_calls"]
    assert list(reasons) == ["length 40 is longer than the longest sequence bucket (32); pass seq_buckets= with "
                             "a longer one"]


def test_64_clients_of_random_lengths_through_the_batcher():
    tr = pytest.importorskip("transformers")
    model, cfg = small_bert(tr, DEV)
    gm = GraphedModule(model, seq_dim=1, max_batch_size=64)
    batcher = Batcher(gm)
    rng = random.Random(1)

    async def client(i):
        g = torch.Generator(device=DEV).manual_seed(i)
        for _ in range(20):
            L = max(1, min(200, int(rng.lognormvariate(3.3, 0.6))))
            inputs = _text(rng.randint(1, 4), L, cfg.vocab_size, pad_tail=rng.choice((0, 0, L // 3)), g=g)
            got = await batcher.acall(**inputs)
            _close(got, eager_answer(model, **inputs))
        return True

    async def main():
        return await asyncio.gather(*(client(i) for i in range(64)))

    assert all(asyncio.run(main()))
    s = batcher.stats()
    print(f"\n64 clients x 20 requests of random lengths: {s['module_calls']} module calls, {s['joined_calls']} "
          f"joined ({s['rows_per_joined_call']:.1f} rows each); padded tokens {gm.stats()['padded_token_share']:.1%}")
    assert s["requests"] == 64 * 20 and s["joined_calls"] > 0


def test_the_memory_budget_drops_and_recaptures_and_every_answer_is_eagers():
    tr = pytest.importorskip("transformers")
    model, cfg = small_bert(tr, DEV)
    gm = GraphedModule(model, seq_dim=1, max_batch_size=8, max_pool_bytes=96 << 20)
    rng = random.Random(2)
    for _ in range(60):
        inputs = _text(rng.randint(1, 8), rng.choice((12, 40, 100, 200, 300)), cfg.vocab_size)
        _close(gm(**inputs), eager_answer(model, **inputs))
    s = gm.stats()
    print(f"\nbudget 96 MiB: {len(s['keys'][0]['buckets'])} buckets seen, graph pool {s['graph_pool_bytes'] / 2**20:.0f} MiB")
    assert s["eager_calls"] == {} or all("max_pool_bytes" in r for r in s["eager_calls"])


@pytest.mark.parametrize("name", ["distilbert", "t5", "gpt2"])
def test_other_text_models_give_eagers_answer_at_every_length(name):
    tr = pytest.importorskip("transformers")
    if name == "distilbert":
        cfg = tr.DistilBertConfig(dim=64, n_layers=2, n_heads=2, hidden_dim=128, vocab_size=500,
                                  max_position_embeddings=600)
        model = tr.DistilBertModel(cfg)
    elif name == "t5":
        cfg = tr.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=500)
        model = tr.T5EncoderModel(cfg)
    else:
        cfg = tr.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=500, n_positions=600)
        model = tr.GPT2Model(cfg)
    model = model.to(DEV).eval()
    gm = GraphedModule(model, seq_dim=1, max_batch_size=8)
    batcher = Batcher(gm)
    rng = random.Random(3)
    lengths = list(range(1, 40)) + [47, 64, 65, 100, 130, 200, 257, 384, 511, 512, 513, 530]
    kw = {"use_cache": False} if name == "gpt2" else {}
    for L in lengths:
        inputs = _text(rng.randint(1, 5), L, 500)
        want = eager_answer(model, **inputs, **kw)
        _close(gm(**inputs, **kw), want)
        _close(batcher(**inputs, **kw), want)
    s = gm.stats()
    assert all("longer than the longest" in r for r in s["eager_calls"]), s["eager_calls"]
    print(f"\n{name}: lengths {s['keys'][0]['lengths']}, padded tokens {s['padded_token_share']:.1%}")
