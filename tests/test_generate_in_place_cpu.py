"""The shared batch reading its paged pool in place, on a CPU: what a GPU does with graphwrap's
attention kernels (each row read to its own length, no mask), here with the kernels' torch
references, which the operators run off a GPU. Tokens against ``model.generate`` alone, what a
step hands the model and the attention, and a long prompt's piece inside the decoding rows' step
forward (graphwrap/decoding/engine/steps.py, step.MixedStep): the probe, a mixed forward that fails,
the capture's layout. Needs transformers (skipped with the reason without it)."""

import threading

import pytest
import torch
from helpers import thread_results

from graphwrap import GraphedModule
from graphwrap.decoding.engine import outputs as outputs_mod
from graphwrap.decoding.engine import pieces, probe
from graphwrap.decoding.engine import pieces as pieces_mod
from graphwrap.decoding.engine import schedule as schedule_mod
from graphwrap.decoding.engine import server as server_mod
from graphwrap.decoding.engine import steps as steps_mod
from graphwrap.decoding.kernels import attention, paged_attention
from graphwrap.decoding.kernels.attention import sdpa_model

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
SHARED = "graphwrap's shared decode batch"


@pytest.fixture
def in_place(monkeypatch):
    """The batch reads its pool in place as on a GPU (where the model's attention is sdpa), and
    prompts past 8 positions go in pieces, one a turn (no ``pieces.BUDGET``): each inside the
    decoding rows' step, which these tests count."""
    monkeypatch.setattr(server_mod, "reads_in_place", lambda model, device, kv=None: sdpa_model(model))
    monkeypatch.setattr(server_mod, "CHUNK", 8)
    monkeypatch.setattr(pieces_mod, "WHOLE", 0)  # (these long prompts go in pieces, found alone or not)
    monkeypatch.setattr(pieces, "BUDGET", None)


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
    # (2-D masks: the probe's forwards through the model's own cache, as generate passes them)
    steps = [m for m in masks if isinstance(m, torch.Tensor) and m.dim() != 2]
    assert len(steps) >= 5 and all(m.dim() == 4 and m.shape[-1] == 1 for m in steps), [tuple(m.shape) for m in steps]
    # Each forward's layers (two) are handed the one tensor its first layer made.
    assert seen and len(seen) % 2 == 0
    assert all(a is b for a, b in zip(seen[::2], seen[1::2]))
    assert all(a is not b for a, b in zip(seen[::2], seen[2::2]))
    gm.close()


def test_steps_over_rows_past_split_from_go_through_the_whole_rows_window_split(in_place, monkeypatch):
    """Rows up to ``SPLIT_FROM`` positions step in the short window (the kernel unsplit), longer
    ones in the whole row's (each row's positions split between programs); tokens as
    ``model.generate``'s either side."""
    monkeypatch.setattr(paged_attention, "SPLIT_FROM", 64)  # (the smallest span bucket)
    model = _model("llama")
    gm = GraphedModule(model)
    splits, attend = [], paged_attention.attend
    monkeypatch.setattr(paged_attention, "attend", lambda *a: splits.append(a[8]) or attend(*a))
    prompts = _prompts([3, 9, 14])
    got = thread_results(lambda i: gm.generate(torch.tensor([prompts[i]]), max_new_tokens=60, do_sample=False), 3)
    for p, out in zip(prompts, got):
        assert torch.equal(out, _alone(model, p, 60))
    server = gm.__dict__["_gw_decode"]
    whole = server.store.per_row * server.store.block
    assert server.store.step_span(64) == 64 and server.store.step_span(65) == whole > 64
    assert set(splits) == {1, paged_attention.SPLITS}, "steps both sides of 64 positions"
    gm.close()


def test_a_step_that_gathers_still_hands_the_model_its_whole_window():
    from graphwrap.decoding.cache.pages import PagedStore

    store = PagedStore(4, 64, "cpu", 16, 20)
    store.allocate([torch.zeros(1, 2, 1, 8)], [torch.zeros(1, 2, 1, 8)])
    window = store.window(32)
    assert not window.in_place and window.span == 32
    store.direct = True
    assert window.in_place, "the base store's switch, as folding sets it"
    twin = store.twin()
    assert twin.window(32).in_place, "a capture's twin reads the base store's switch"


def _beside(gm, model, short, long, news=40, long_news=6, ready=None):
    """The short prompts decode (``news`` tokens each); once they do (or once ``ready()``), the
    long ones arrive: every call's tokens against ``model.generate`` alone."""
    server = gm.__dict__["_gw_decode"]
    ready = ready or (lambda: len(server.sched.live()) >= len(short))
    outs = {}

    def run(i, p, n):
        outs[i] = gm.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)

    first = [threading.Thread(target=run, args=(i, p, news)) for i, p in enumerate(short)]
    for t in first:
        t.start()
    while not ready():
        threading.Event().wait(0.001)
    # (queued from this thread at once: a thread started now might get to queue after the rows ended)
    got = [f.result(timeout=120) for f in
           [gm.submit_generate(torch.tensor([p]), max_new_tokens=long_news, do_sample=False) for p in long]]
    for t in first:
        t.join()
    for i, p in enumerate(short):
        assert torch.equal(outs[i], _alone(model, p, news)), f"short prompt {i}"
    for p, out in zip(long, got):
        assert torch.equal(out, _alone(model, p, long_news)), "long prompt"


# ------------------------------------------------------------------ a piece inside the step


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mistral", "gemma2"])
def test_pieces_inside_the_step_give_generates_tokens_to_both(in_place, kind):
    model = _model(kind)
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6]]), max_new_tokens=1)  # (the batch made)
    server = gm.__dict__["_gw_decode"]
    _beside(gm, model, _prompts([3, 6, 2, 5]), _prompts([30, 19], seed=2))
    d = gm.stats()["decode"]
    if sdpa_model(model):  # (transformers 5.24 makes Gemma 2's attention eager: nothing read in place)
        assert server.mixed_engine is not None
        assert d["mixed_steps"] > 0 and not d["mixed_failed"], d
    else:
        assert server.mixed_engine is None and d["mixed_steps"] == 0
    assert d["prefill_pieces"] >= 3 + 2 + 1
    assert gm.stats()["generate"] == {SHARED: 7}
    gm.close()


def test_the_probe_passes_the_families_and_finds_a_wrong_attention(in_place, monkeypatch):
    for kind in ("llama", "gpt2", "mistral"):
        assert probe.probe_mixed(_model(kind), "cpu") is None, kind
    model = _model("llama")

    def shifted(*args):
        return mixed(*args) + 1.0  # every position's attention off by one

    mixed = attention._mixed
    monkeypatch.setattr(attention, "_mixed", shifted)
    why = probe.probe_mixed(model, "cpu")
    assert why is not None and "differs" in why
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6]]), max_new_tokens=1)
    server = gm.__dict__["_gw_decode"]
    assert server.mixed_engine is None, "the batch runs pieces apart"
    _beside(gm, model, _prompts([3, 6]), _prompts([21], seed=2))
    d = gm.stats()["decode"]
    assert d["mixed_steps"] == 0 and d["prefill_pieces"] >= 3
    gm.close()


def test_a_mixed_forward_that_fails_runs_apart_and_every_call_gets_its_tokens(in_place, monkeypatch):
    model = _model("llama")
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6]]), max_new_tokens=1)
    failures = []
    mixed = attention._mixed

    def fails_twice(*args):
        if len(failures) < 2:
            failures.append(1)
            raise RuntimeError("a mixed forward that fails")
        return mixed(*args)

    monkeypatch.setattr(attention, "_mixed", fails_twice)
    _beside(gm, model, _prompts([3, 6, 4]), _prompts([30], seed=3))
    d = gm.stats()["decode"]
    assert d["mixed_failed"] == 2 and d["mixed_steps"] > 0, d
    gm.close()


def test_a_prompt_the_model_refuses_fails_alone_beside_mixed_steps(in_place):
    model = _model("llama")  # 256 positions: a prompt past them is refused before any piece
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6]]), max_new_tokens=1)
    server = gm.__dict__["_gw_decode"]
    out = {}

    def short():
        out["short"] = gm.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=40, do_sample=False)

    t = threading.Thread(target=short)
    t.start()
    while not server.sched.live():
        threading.Event().wait(0.001)
    with pytest.raises(Exception):
        gm.generate(torch.tensor([_prompts([300])[0]]), max_new_tokens=4)
    long = _prompts([25], seed=4)[0]
    assert torch.equal(gm.generate(torch.tensor([long]), max_new_tokens=4, do_sample=False), _alone(model, long, 4))
    t.join()
    assert torch.equal(out["short"], _alone(model, [3, 4, 5], 40))
    gm.close()


def test_a_mixed_capture_puts_the_piece_in_the_scratch_row_over_its_own_blocks():
    from graphwrap.decoding.cache.pages import PagedStore
    from graphwrap.decoding.cache.pool import blocks_for

    store = PagedStore(4, 64, "cpu", 16, 40, kernel=True)
    twin = store.mixed_twin(16)
    first = store.rows + 1 + blocks_for(store.rows + 1, store.block)
    assert twin.table[store.scratch].tolist() == [first] * store.per_row, "the piece's own capture block"
    plain = store.twin()
    assert torch.equal(twin.table[:store.rows], plain.table[:store.rows]), "the steps' rows as a step's capture"
    assert twin.lengths.tolist() == plain.lengths.tolist()
    assert not store.table.eq(first).any(), "no row of the store points there"


def test_rows_preempted_beside_mixed_steps_are_recomputed_with_generates_tokens(in_place, monkeypatch):
    """A pool too small for every row at once: the newest gives its blocks back and is recomputed
    (ahead of the long prompt, queued last), while the long prompt's pieces go inside the steps
    of the rows left. Every call is queued, the short ones first, before the first is admitted:
    which rows run together does not hang on when the callers' threads get to queue."""
    from graphwrap.decoding.cache.pool import BLOCK, scratch_blocks
    model = _model("llama")
    token_bytes = 2 * 2 * 2 * 16 * 4  # layers x (keys, values) x key heads x head width x fp32
    usable = 8  # blocks of 16 (128 positions) for 4 rows growing to 60 each
    free = int(((usable + scratch_blocks(4, BLOCK)) * BLOCK * token_bytes + 1) / server_mod.CACHE_MEMORY) + 1
    monkeypatch.setattr(server_mod, "_free_memory", lambda device: free)
    gm = GraphedModule(model, decode={"rows": 4})
    gm.generate(torch.tensor([[5, 6]]), max_new_tokens=1)
    d = gm.stats()["decode"]
    assert d["cache_blocks"]["free"] == usable, d["cache_blocks"]
    server, admitted = gm.__dict__["_gw_decode"], schedule_mod.admitted
    calls = server.counts["calls"] + 4
    monkeypatch.setattr(schedule_mod, "admitted", lambda server: admitted(server) if server.counts["calls"] >= calls else [])
    _beside(gm, model, _prompts([5, 7, 4]), _prompts([30], seed=5), news=55, long_news=30,
            ready=lambda: len(server.sched.queue) == 3)
    d = gm.stats()["decode"]
    assert d["preempted"] > 0 and d["mixed_steps"] > 0 and not d["mixed_failed"], d
    assert d["cache_blocks"] == {"block": BLOCK, "used": 0, "free": usable}
    gm.close()


def test_a_turn_with_a_mixed_step_leaves_its_tokens_in_flight_as_a_step_does(in_place, monkeypatch):
    """The host reads the rows' tokens of a mixed step a turn later, as a plain step's: reading
    them at once would wait for the forward just queued, the device idle until the next."""
    model = _model("llama")
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6]]), max_new_tokens=1)
    seen = []
    together, read = steps_mod.together, outputs_mod.read
    monkeypatch.setattr(steps_mod, "together", lambda server: seen.append(together(server)) or seen[-1])
    monkeypatch.setattr(outputs_mod, "read", lambda server, keep: seen.append(("keep", keep)) or read(server, keep))
    _beside(gm, model, _prompts([3, 6]), _prompts([30], seed=2))
    after = [seen[i + 1] for i, x in enumerate(seen[:-1]) if x is True]
    assert after and all(k == ("keep", outputs_mod.AHEAD) for k in after), after
    gm.close()


def test_pieces_inside_steps_under_inference_mode(in_place):
    model = _model("mistral")
    gm = GraphedModule(model)
    with torch.inference_mode():
        gm.generate(torch.tensor([[5, 6]]), max_new_tokens=1)
        _beside(gm, model, _prompts([4, 9]), _prompts([26], seed=6))
    assert gm.stats()["decode"]["mixed_steps"] > 0
    gm.close()


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_with_the_budget_a_turns_first_piece_goes_inside_the_step_and_the_rest_beside_it(in_place, monkeypatch,
                                                                                           kind):
    """``pieces.BUDGET`` (on by default): a turn's first piece inside the rows' step, the
    others of its budget after it; every call's tokens are generate's."""
    monkeypatch.setattr(pieces, "BUDGET", 32)  # (pieces of 8: four a turn)
    model = _model(kind)
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6]]), max_new_tokens=1)
    _beside(gm, model, _prompts([4, 9, 3]), _prompts([60, 26], seed=9), news=50)
    d = gm.stats()["decode"]
    assert d["mixed_steps"] > 0 and d["budget_pieces"] > 0 and not d["mixed_failed"], d
    gm.close()


def test_a_long_prompt_cancelled_between_its_pieces_inside_steps_frees_its_row(in_place):
    model = _model("llama")
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6]]), max_new_tokens=1)
    server = gm.__dict__["_gw_decode"]
    short = gm.submit_generate(torch.tensor([[3, 4, 5]]), max_new_tokens=80, do_sample=False)
    while not server.sched.live():
        threading.Event().wait(0.001)
    long = gm.submit_generate(torch.tensor([_prompts([100], seed=7)[0]]), max_new_tokens=5, do_sample=False)
    while server.counts["mixed_steps"] < 2:  # (two of its 13 pieces in)
        threading.Event().wait(0.001)
    assert long.cancel()
    again = _prompts([30], seed=8)[0]
    assert torch.equal(gm.generate(torch.tensor([again]), max_new_tokens=5, do_sample=False), _alone(model, again, 5))
    assert torch.equal(short.result(timeout=60), _alone(model, [3, 4, 5], 80))
    d = gm.stats()["decode"]
    assert d["cancelled"] == 1 and d["rows_busy"] == 0 and d["cache_blocks"]["used"] == 0, d
    assert d["mixed_steps"] >= 2 + 3, "the next long prompt's pieces inside the steps too"
    gm.close()
