"""A long prompt that finds the shared batch empty goes in one forward (graphwrap/decoding/engine/
pieces.py, ``prefill_whole``), on a CPU, eagerly, against model.generate alone: its tokens, the
attention calls model.generate's prefill makes, the limit, a batch that is not empty, a device
without memory for the forward and a model that raises. Needs transformers (skipped with the
reason without it)."""

import logging
import time

import pytest
import torch
from test_generate_paged_cpu import _alone, _Collect, _model, _prompts, _windowed

from graphwrap import GraphedModule
from graphwrap.decoding.engine import pieces
from graphwrap.decoding.engine import server as server_mod
from graphwrap.decoding.engine.step import WholeStep

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")


@pytest.fixture
def chunk_8(monkeypatch):
    """Prompts past 8 tokens are long (they go in pieces, or whole where alone)."""
    monkeypatch.setattr(server_mod, "CHUNK", 8)


def test_where_pieces_are_graphs_a_prompt_goes_whole_only_from_enough_operations():
    """``2 x weights x positions`` against ``WHOLE_FROM``, where the pieces replay graphs (an
    eager forward's host time); on a CPU, where pieces run eagerly too, from the chunk up."""
    from types import SimpleNamespace

    def server(graphs: bool, weights: int, holders=(None,)):
        sched = SimpleNamespace(chunking=[], holders=list(holders))
        store = pieces.PagedStore.__new__(pieces.PagedStore) if graphs else object()
        return SimpleNamespace(whole_limit=None, beside=None, sched=sched, store=store, piece_engine=object(),
                               weights=SimpleNamespace(count=weights), device=torch.device("cuda" if graphs else "cpu"))

    def seq(n):
        return SimpleNamespace(feed=[1] * n)

    eight_b = 8_000_000_000
    assert pieces.goes_whole(server(True, eight_b), seq(2000))  # 3.2e13
    assert not pieces.goes_whole(server(True, eight_b), seq(1999))
    assert not pieces.goes_whole(server(True, 1_100_000_000), seq(8000)), "a 1.1B model's pieces stay graphs"
    assert pieces.goes_whole(server(False, 1_100_000_000), seq(600))
    assert not pieces.goes_whole(server(True, eight_b), seq(pieces.WHOLE + 1)), "past the limit"


def test_beside_decoding_rows_a_long_prompt_goes_whole_within_the_turns_prompt_budget():
    """Within the prompt tokens a turn admits beside decoding rows (``decode={"prefill_beside"}``,
    8,192 by default; 0: no bound) a long prompt goes in one forward, the rows waiting for it
    once; past them, only where no row decodes yet: the prompts admitted in the same turn decode
    only after its forward (theirs are prefilled after it)."""
    from types import SimpleNamespace

    long_one = SimpleNamespace(feed=[1] * 600, needs_steps=True)
    short = SimpleNamespace(feed=[1] * 5, needs_steps=True)
    done = SimpleNamespace(feed=[1] * 5, needs_steps=False)  # (ended, its row not yet given back)
    sched = SimpleNamespace(chunking=[], holders=[long_one, short, done, None])
    server = SimpleNamespace(whole_limit=None, beside=None, sched=sched, store=object(), piece_engine=None,
                             weights=SimpleNamespace(count=1), device=torch.device("cpu"))
    assert pieces.goes_whole(server, long_one, [long_one]), "600 tokens within 8,192: the decoding short waits once"
    server.beside = 0
    assert pieces.goes_whole(server, long_one, [long_one]), "no bound"
    server.beside = 599
    assert pieces.goes_whole(server, long_one, [long_one, short]), "the short came with it"
    assert not pieces.goes_whole(server, long_one, [long_one]), "the short decodes already"
    sched.holders[1] = None
    assert pieces.goes_whole(server, long_one, [long_one])
    sched.chunking.append(short)
    assert not pieces.goes_whole(server, long_one, [long_one]), "another prompt goes in pieces"


@pytest.mark.parametrize("kind,paged", [("llama", True), ("llama", False), ("gpt2", True), ("mistral", True),
                                        ("gemma2", True)])
def test_a_long_prompt_alone_goes_in_one_forward_with_generates_tokens(chunk_8, kind, paged):
    """The sliding-window models' prompts (30, 61) are longer than their window (4)."""
    model = _model(kind) if kind in ("llama", "gpt2") else _windowed(kind)
    gm = GraphedModule(model, decode={"paged": paged})
    for i, n in enumerate((30, 61)):
        prompt = _prompts([n], seed=i)[0]
        assert torch.equal(gm.generate(torch.tensor([prompt]), max_new_tokens=12),
                           _alone(model, prompt, max_new_tokens=12))
    d = gm.stats()["decode"]
    assert d["whole_prefills"] == 2 and d["prefill_pieces"] == 0, d
    assert d["prefill_whole"] == pieces.WHOLE
    gm.close()


def test_its_attention_is_called_as_generates_prefill_calls_it(chunk_8, monkeypatch):
    """No mask where ``model.generate``'s prefill has none (``is_causal``: the fused kernels), the
    same where it has one: each call's (query positions, mask given, is_causal) alike."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((q.shape[-2], attn_mask is None, bool(is_causal)))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    model = _model("llama")
    model.config._attn_implementation = "sdpa"
    gm = GraphedModule(model)
    prompt = _prompts([40])[0]
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    _alone(model, prompt, max_new_tokens=1)
    eager = [c for c in calls if c[0] == 40]
    calls.clear()
    gm.generate(torch.tensor([prompt]), max_new_tokens=1)
    ours = [c for c in calls if c[0] == 40]
    assert gm.stats()["decode"]["whole_prefills"] == 1
    assert eager and ours == eager, (ours, eager)
    gm.close()


def test_past_the_limit_or_with_it_off_a_long_prompt_alone_goes_in_pieces(chunk_8):
    model = _model("llama")
    for limit, whole in ((30, 1), (29, 0), (0, 0)):
        gm = GraphedModule(model, decode={"prefill_whole": limit})
        prompt = _prompts([30], seed=limit)[0]
        assert torch.equal(gm.generate(torch.tensor([prompt]), max_new_tokens=6), _alone(model, prompt, max_new_tokens=6))
        d = gm.stats()["decode"]
        assert d["prefill_whole"] == limit and d["whole_prefills"] == whole, d
        assert (d["prefill_pieces"] > 0) == (not whole), d
        gm.close()


@pytest.mark.parametrize("bound", [16, None])
def test_beside_a_decoding_row_a_long_prompt_goes_in_pieces_past_the_turns_prompt_budget(chunk_8, monkeypatch, bound):
    """A 40-token prompt beside a decoding row: in pieces where a turn admits 16 prompt tokens
    beside decoding rows, in one forward within the default 8,192; generate's tokens either way."""
    from graphwrap.decoding.engine.step import DecodeStep

    step = DecodeStep.forward

    def slow_step(self, *args, **kwargs):  # (the short row still decodes when the long prompt comes)
        time.sleep(0.005)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(DecodeStep, "forward", slow_step)
    model = _model("llama")
    gm = GraphedModule(model, decode={"prefill_beside": bound} if bound is not None else None)
    short, seen = _prompts([5], seed=2)[0], _Collect()
    beside = gm.submit_generate(torch.tensor([short]), max_new_tokens=100, streamer=seen)
    deadline = time.monotonic() + 60
    while len(seen.got) < len(short) + 2:  # (its prompt's ids, then its first tokens: it decodes)
        assert time.monotonic() < deadline
        time.sleep(0.002)
    prompt = _prompts([40], seed=3)[0]
    assert torch.equal(gm.generate(torch.tensor([prompt]), max_new_tokens=6), _alone(model, prompt, max_new_tokens=6))
    assert torch.equal(beside.result(timeout=60), _alone(model, short, max_new_tokens=100))
    d = gm.stats()["decode"]
    if bound is not None:
        assert d["whole_prefills"] == 0 and d["prefill_pieces"] >= 5, d
    else:
        assert d["whole_prefills"] == 1 and d["prefill_pieces"] == 0, d
    gm.close()


def test_without_memory_for_the_forward_the_prompt_goes_in_pieces_and_says_so(chunk_8, monkeypatch, caplog):
    def no_memory(self, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test's)")

    monkeypatch.setattr(WholeStep, "forward", no_memory)
    model = _model("llama")
    gm = GraphedModule(model)
    prompt = _prompts([40])[0]
    with caplog.at_level(logging.WARNING, logger="graphwrap"):
        assert torch.equal(gm.generate(torch.tensor([prompt]), max_new_tokens=6),
                           _alone(model, prompt, max_new_tokens=6))
    d = gm.stats()["decode"]
    assert d["whole_no_memory"] == 1 and d["whole_prefills"] == 0 and d["prefill_pieces"] == 5, d
    assert "40-token prompt alone had no memory for one forward" in caplog.text
    gm.close()


def test_a_model_that_raises_in_the_forward_fails_that_call_alone(chunk_8, monkeypatch):
    forward = WholeStep.forward

    def fails_on_41(self, input_ids, slot, rows):
        if input_ids.shape[1] == 41:
            raise RuntimeError("the model failed on this prompt")
        return forward(self, input_ids, slot, rows)

    monkeypatch.setattr(WholeStep, "forward", fails_on_41)
    model = _model("llama")
    gm = GraphedModule(model)
    bad, good = _prompts([41, 40])
    with pytest.raises(RuntimeError, match="the model failed on this prompt"):
        gm.generate(torch.tensor([bad]), max_new_tokens=6)
    assert torch.equal(gm.generate(torch.tensor([good]), max_new_tokens=6), _alone(model, good, max_new_tokens=6))
    d = gm.stats()["decode"]
    assert d["failed"] == 1 and d["whole_prefills"] == 1 and d["cache_blocks"]["used"] == 0, d
    gm.close()


def test_admitted_with_short_prompts_it_goes_first_in_one_forward(chunk_8):
    """A long prompt and short ones queued together (the batch's lock held meanwhile, so one turn
    admits them all): the long one in one forward, the shorts' prompts after it, every answer
    model.generate's."""
    model = _model("llama")
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)  # (the batch made, its thread idle)
    server = gm.__dict__["_gw_decode"]
    prompts = _prompts([40, 5, 6, 7], seed=4)
    with server.cond:
        futures = [gm.submit_generate(torch.tensor([p]), max_new_tokens=8) for p in prompts]
    for p, f in zip(prompts, futures):
        assert torch.equal(f.result(timeout=60), _alone(model, p, max_new_tokens=8))
    d = gm.stats()["decode"]
    assert d["whole_prefills"] == 1 and d["prefill_pieces"] == 0, d
    gm.close()


def test_a_whole_prompts_streamer_that_raises_a_cancel_and_a_bad_request_each_end_alone(chunk_8):
    """Under ``inference_mode``, queued together: a long prompt (one forward) whose streamer raises
    on its first token, a long one cancelled while queued, a short one beside them, and a request
    with a token id past the vocabulary (refused at once); the short gets model.generate's
    tokens, the others end each with its own reason, and every block comes back."""
    from test_generate_alone_cpu import Collect

    from graphwrap import GraphwrapError

    model = _model("llama")
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    server = gm.__dict__["_gw_decode"]
    long_one, other, short = _prompts([40, 41, 5], seed=6)
    loud = Collect(raise_at=1, error=ValueError("the streamer's own error"))
    with torch.inference_mode():
        with server.cond:
            failing = gm.submit_generate(torch.tensor([long_one]), max_new_tokens=8, streamer=loud)
            cancelled = gm.submit_generate(torch.tensor([other]), max_new_tokens=8)
            fine = gm.submit_generate(torch.tensor([short]), max_new_tokens=8)
            assert cancelled.cancel()
        with pytest.raises(GraphwrapError, match="vocabulary|token id"):
            gm.generate(torch.tensor([[5, 6, 5000]]), max_new_tokens=4)
        with pytest.raises(ValueError, match="the streamer's own error"):
            failing.result(timeout=60)
        assert torch.equal(fine.result(timeout=60), _alone(model, short, max_new_tokens=8))
    assert cancelled.cancelled()
    deadline = time.monotonic() + 30
    while gm.stats()["decode"]["cache_blocks"]["used"] and time.monotonic() < deadline:
        time.sleep(0.01)
    d = gm.stats()["decode"]
    assert d["whole_prefills"] == 1 and d["cache_blocks"]["used"] == 0, d
    gm.close()
