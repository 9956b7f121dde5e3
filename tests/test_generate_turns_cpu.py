"""Calls the shared batch does not serve, waiting for their turn on the model together, run as
one batch (graphwrap/decoding/callers/turns.py): which calls may be joined, the join, where each call's
output is cut, the turn itself, and tokens against ``model.generate`` alone for T5, BART,
Whisper and a decoder-only call of a setting the shared batch leaves to the one-call loop."""

import threading
import time

import pytest
import torch
from helpers import ending_eos, generate_alone, held_turn, hold_turn, release_turn, varied_weights

from graphwrap import GraphedModule, GraphwrapError
from graphwrap.decoding.callers import turns

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")


def _model(name, pad=0, eos=2):
    torch.manual_seed(0)
    common = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)
    if name == "t5":
        cfg = tr.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        return tr.T5ForConditionalGeneration(cfg).eval()
    if name == "bart":
        cfg = tr.BartConfig(**common, max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                            decoder_start_token_id=2, forced_eos_token_id=None)
        return tr.BartForConditionalGeneration(cfg).eval()
    if name == "whisper":
        cfg = tr.WhisperConfig(**common, num_mel_bins=16, max_source_positions=32, max_target_positions=64,
                               pad_token_id=pad, bos_token_id=1, eos_token_id=eos, decoder_start_token_id=1,
                               suppress_tokens=[], begin_suppress_tokens=[])
        return tr.WhisperForConditionalGeneration(cfg).eval()
    cfg = tr.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=128, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0)
    return tr.GPT2LMHeadModel(cfg).eval()


def _inputs(name, rows, seed):
    g = torch.Generator().manual_seed(seed)
    if name == "whisper":
        return dict(input_features=torch.randn(rows, 16, 64, generator=g))
    ids = torch.randint(3, 60, (rows, 10), generator=g)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


# ------------------------------------------------------------------ which calls may be joined


def test_calls_alike_share_a_key_and_whatever_differs_keeps_them_apart():
    model = _model("t5")
    ids = torch.randint(3, 60, (1, 10))
    a = turns.waiter(model, (), dict(input_ids=ids, max_new_tokens=5))
    assert a.key is not None and a.rows == 1 and a.rule.kind == "loop" and a.rule.eos == (1,)
    assert turns.waiter(model, (), dict(input_ids=ids + 1, max_new_tokens=5)).key == a.key
    assert turns.waiter(model, (), dict(input_ids=ids.repeat(3, 1), max_new_tokens=5)).rows == 3
    # (a text encoder-decoder's prompts of other lengths join, padded: see the tests below)
    assert a.pad == 0 and turns.waiter(model, (), dict(input_ids=torch.randint(3, 60, (1, 11)), max_new_tokens=5,
                                                        attention_mask=torch.ones(1, 11))).key == a.key
    for other in (dict(input_ids=ids, max_new_tokens=6), dict(input_ids=ids.int(), max_new_tokens=5)):
        w = turns.waiter(model, (), other)
        assert w.key is not None and w.key != a.key, other
    padless = turns.waiter(model, (), dict(input_ids=torch.tensor([[3, 0, 5] + [4] * 7]), max_new_tokens=5))
    assert padless.pad is None and padless.key != a.key, "a pad in a prompt without a mask: joined at its length only"
    positional = turns.waiter(model, (ids,), dict(max_new_tokens=5))
    assert positional.key is not None and positional.key != a.key
    for alone in (dict(do_sample=True), dict(num_beams=2), dict(streamer=object()), dict(logits_processor=[]),
                  dict(bad_words_ids=torch.tensor([[4]])), dict(max_time=1.0),
                  dict(generation_config=model.generation_config), dict(num_return_sequences=2)):
        assert turns.waiter(model, (), dict(input_ids=ids, max_new_tokens=5, **alone)).key is None, alone
    assert turns.waiter(model, (ids, ids), {}).key is None


def test_prompts_of_other_lengths_join_only_where_the_model_masks_padding():
    gpt2 = _model("gpt2")
    ids = torch.randint(3, 60, (1, 10))
    a = turns.waiter(gpt2, (), dict(input_ids=ids, max_new_tokens=5))
    assert a.key is not None and a.pad is None, "a decoder-only prompt: its length is where its output starts"
    assert turns.waiter(gpt2, (), dict(input_ids=torch.randint(3, 60, (1, 11)), max_new_tokens=5)).key != a.key
    t5 = _model("t5")
    turns._HONOURS[t5] = False  # (found by a join before: the model reads padded positions)
    try:
        b = turns.waiter(t5, (), dict(input_ids=ids, max_new_tokens=5))
        assert b.pad is None and b.key != turns.waiter(t5, (), dict(input_ids=ids[:, :9], max_new_tokens=5)).key
    finally:
        del turns._HONOURS[t5]


def test_whisper_is_joined_short_form_where_its_pad_is_its_end_of_sequence():
    features = torch.randn(1, 16, 64)
    w = turns.waiter(_model("whisper", pad=2, eos=2), (), dict(input_features=features, max_new_tokens=5))
    assert w.key is not None and w.rule.kind == "whisper" and w.rule.pad == 2
    # A pad of its own: Whisper strips every pad of a row before padding the batch, so a row's
    # output would depend on how far the batch padded it.
    assert turns.waiter(_model("whisper", pad=0, eos=2), (), dict(input_features=features)).key is None
    longer = torch.randn(1, 16, 65)  # past the encoder's window: segments, long-form
    assert turns.waiter(_model("whisper", pad=2, eos=2), (), dict(input_features=longer)).key is None
    stamped = _model("whisper", pad=2, eos=2)
    stamped.generation_config.return_timestamps = True  # (segments of their own)
    assert turns.waiter(stamped, (), dict(input_features=features)).key is None


# ------------------------------------------------------------------ the join and the split


def test_the_join_pads_the_rows_to_a_power_of_two_with_copies_of_the_last():
    a = turns.Waiter((), dict(input_ids=torch.tensor([[1, 2]]), attention_mask=torch.tensor([[1, 1]]), x=3), rows=1)
    b = turns.Waiter((), dict(input_ids=torch.tensor([[3, 4], [5, 6]]), attention_mask=torch.tensor([[0, 1], [1, 1]]),
                              x=3), rows=2)
    args, kwargs, rows = turns.join([a, b])
    assert args == () and rows == 4 and kwargs["x"] == 3
    assert kwargs["input_ids"].tolist() == [[1, 2], [3, 4], [5, 6], [5, 6]]
    assert kwargs["attention_mask"].tolist() == [[1, 1], [0, 1], [1, 1], [1, 1]]
    args, kwargs, rows = turns.join([turns.Waiter((torch.tensor([[7]]),), {}, rows=1)] * 3)
    assert rows == 4 and args[0].tolist() == [[7], [7], [7], [7]] and kwargs == {}
    # Prompts of other lengths, padded with the model's pad and masked (ones where no mask was given)
    c = turns.Waiter((), dict(input_ids=torch.tensor([[3, 4, 5]]), x=1), rows=1, pad=0)
    d = turns.Waiter((), dict(input_ids=torch.tensor([[6]]), attention_mask=torch.tensor([[1]]), x=1), rows=1, pad=0)
    args, kwargs, rows = turns.join([c, d])
    assert kwargs["input_ids"].tolist() == [[3, 4, 5], [6, 0, 0]]
    assert kwargs["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]] and rows == 2
    assert [turns.bucket_of(n) for n in (1, 2, 3, 5, 31, 32, 33)] == [1, 2, 4, 8, 32, 32, 64]


def test_the_split_cuts_each_call_where_the_last_of_its_rows_ends():
    out = torch.tensor([[0, 1, 5, 1, 0, 0],  # its end at column 3 (column 1 is the prompt's)
                        [0, 7, 5, 6, 7, 8],  # no end: the whole length
                        [0, 7, 1, 0, 0, 0],  # its end at column 2
                        [0, 7, 1, 0, 0, 0]])  # a copy padding the bucket
    a, b = turns.split(out, [1, 2], turns.EndsRule("loop", eos=(1,), start=2))
    assert a.tolist() == [[0, 1, 5, 1]] and b.tolist() == out[1:3].tolist()
    c, d = turns.split(out, [1, 1], turns.EndsRule("loop", eos=(1, 8), start=2))
    assert c.tolist() == [[0, 1, 5, 1]] and d.tolist() == [out[1].tolist()]
    assert turns.split(out, [2], turns.EndsRule("loop", eos=(9,), start=2))[0].tolist() == out[:2].tolist()
    e, f = turns.split(out, [2, 1], turns.EndsRule("loop", eos=(1,), start=1))
    assert e.tolist() == out[:2].tolist() and f.tolist() == [[0, 7, 1]]
    w = torch.tensor([[4, 5, 2, 2], [4, 2, 2, 2], [4, 5, 6, 7]])  # Whisper's: rows padded with its end
    g, h = turns.split(w, [2, 1], turns.EndsRule("whisper", pad=2))
    assert g.tolist() == [[4, 5], [4, 2]] and h.tolist() == [[4, 5, 6, 7]]
    assert turns.split(out, [1], turns.EndsRule("loop", eos=(1,))) is None, "no start: the split cannot be told"


# ------------------------------------------------------------------ the turn


def _calls(t, waiters, most_rows, run):
    """Every waiter queued while the turn is held, then the turn let go: their outcomes."""
    return held_turn(t, len(waiters), lambda i: turns.take(t, waiters[i], most_rows, run))


def _echo(runs):
    """A run whose output is its input ids (and which fails on an id of 99)."""
    def run(args, kwargs, calls, starts):
        ids = kwargs["input_ids"]
        runs.append((calls, ids.shape[0]))
        if (ids == 99).any():
            raise ValueError("99 is not an id")
        if starts is not None:
            starts.append(0)
        return ids.clone()
    return run


def _waiter(value, rows=1, key="k"):
    return turns.Waiter((), dict(input_ids=torch.full((rows, 3), value)), key=key, rows=rows,
                        rule=turns.EndsRule("loop", eos=()))


def test_calls_that_wait_together_run_as_one_and_each_gets_its_own_rows():
    t, runs = turns.Turns(), []
    waiters = [_waiter(i, rows=1 + i % 2) for i in range(5)] + [_waiter(7, key=None)]
    got = _calls(t, waiters, 64, _echo(runs))
    for i, w in enumerate(waiters):
        assert got[i].tolist() == w.kwargs["input_ids"].tolist(), i
    assert sorted(runs) == [(1, 1), (5, 8)], "five calls of 7 rows in one run padded to 8; the other alone"
    assert t.counts == {"turns": 2, "joined_turns": 1, "joined_calls": 5, "joins_undone": 0}
    assert not t.busy and not t.waiting


def test_turns_go_in_the_order_the_calls_came():
    t, order = turns.Turns(), []

    def run(args, kwargs, calls, starts):
        order.append(int(kwargs["input_ids"][0, 0]))
        return kwargs["input_ids"]

    hold_turn(t)
    threads = []
    for i in range(6):  # (each queued before the next starts)
        threads.append(threading.Thread(target=turns.take, args=(t, _waiter(i, key=None), 64, run)))
        threads[-1].start()
        while len(t.waiting) < i + 1:
            threading.Event().wait(0.001)
    release_turn(t, 6)
    for th in threads:
        th.join()
    assert order == list(range(6))


def test_a_joined_turn_takes_at_most_its_rows_and_the_rest_wait_for_the_next():
    t, runs = turns.Turns(), []
    got = _calls(t, [_waiter(i, rows=2) for i in range(3)], 4, _echo(runs))
    assert [g.shape[0] for g in got] == [2, 2, 2]
    assert sorted(runs) == [(1, 2), (2, 4)]


def test_a_joined_turn_that_fails_runs_each_call_alone_and_only_the_bad_one_fails():
    t, runs = turns.Turns(), []
    waiters = [_waiter(1), _waiter(99), _waiter(3)]
    got = _calls(t, waiters, 64, _echo(runs))
    assert isinstance(got[1], ValueError)
    assert got[0].tolist() == [[1, 1, 1]] and got[2].tolist() == [[3, 3, 3]]
    assert runs[0] == (3, 4) and sorted(runs[1:]) == [(1, 1)] * 3
    assert t.counts["joins_undone"] == 1 and t.counts["joined_turns"] == 0


def test_a_joined_run_whose_prompt_is_not_known_runs_each_callgenerate_alone():
    t, runs = turns.Turns(), []

    def run(args, kwargs, calls, starts):  # (transformers' own loop ran: graphwrap's did not see the prompt)
        runs.append(calls)
        return kwargs["input_ids"].clone()

    got = _calls(t, [_waiter(1), _waiter(2)], 64, run)
    assert [g.tolist() for g in got] == [[[1, 1, 1]], [[2, 2, 2]]]
    assert sorted(runs) == [1, 1, 2]


# ------------------------------------------------------------------ tokens against model.generate alone


def _together(gm, model, calls, kw, inference=False, refused=0):
    """Every call queued for the turn before the first takes it (each under inference_mode where
    asked; ``refused`` of them fail before they queue); their outputs, or the error each raised."""
    t = turns.turns_of(model)

    def one(i):
        with torch.inference_mode(inference):
            return gm.generate(**calls[i], **kw)

    return held_turn(t, len(calls), one, len(calls) - refused), t.counts


@pytest.mark.parametrize("name", ["t5", "bart", "whisper", "gpt2"])
def test_concurrent_calls_joined_give_generates_tokens_each(name):
    model = varied_weights(_model(name, pad=2, eos=2))
    # (no token twice in a row's output: these tiny models' rows otherwise repeat one token; the
    # shared batch leaves the setting to the one-call loop, so the decoder-only calls go there too)
    kw = dict(max_new_tokens=12, no_repeat_ngram_size=1)
    calls = [_inputs(name, 1 + i % 2, i) for i in range(7)]
    kw, want = ending_eos(model, name, calls, kw)
    gm = GraphedModule(model)
    got, counts = _together(gm, model, calls, kw, inference=name in ("t5", "whisper"))  # (callers in inference_mode too)
    for i, w in enumerate(want):
        assert torch.equal(got[i], w), (name, i, got[i], w.tolist())
    assert counts["joined_turns"] == 1 and counts["joined_calls"] == len(calls), counts
    assert sum(gm.stats()["generate"].values()) == len(calls), "each call counted"
    assert gm.stats()["generate_turns"] == counts


@pytest.mark.parametrize("change", ["weights scaled in place", "model.double()"])
def test_a_model_changed_while_calls_wait_for_their_turn_gives_the_changed_models_tokens(change):
    """Calls queued for a joined turn, then the model changed behind the wrapper before the turn
    begins: the joined run sees the model as it is then, each call's tokens the changed model's."""
    model = varied_weights(_model("t5"))
    kw = dict(max_new_tokens=8, no_repeat_ngram_size=1)
    calls = _texts([6, 9, 7, 5])
    gm = GraphedModule(model)
    gm.generate(**calls[0], **kw)  # (a first call: the model's loop and caches made before the change)
    before = generate_alone(model, calls, kw)
    t = turns.turns_of(model)
    hold_turn(t)
    got = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, gm.generate(**calls[i], **kw)))
               for i in range(len(calls))]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 60
    while len(t.waiting) < len(calls):
        assert time.monotonic() < deadline, "the calls never queued"
        time.sleep(0.001)
    with torch.no_grad():
        if change == "model.double()":
            model.double()
        else:
            for p in model.parameters():
                p.mul_(1.5)
    release_turn(t, len(calls))
    for th in threads:
        th.join()
    want = generate_alone(model, calls, kw)
    if change != "model.double()":  # (float64 makes float32's tokens: what is tested there is the new dtype)
        assert any(not torch.equal(b, w) for b, w in zip(before, want)), "the change changes the tokens"
    for i, w in enumerate(want):
        assert torch.equal(got[i], w), (change, i)
    assert t.counts["joined_turns"] >= 1


def test_a_bad_call_beside_good_ones_fails_alone_and_the_others_are_joined():
    model = varied_weights(_model("t5"))
    kw = dict(max_new_tokens=8, no_repeat_ngram_size=1)
    calls = _texts([6, 9, 7, 5])
    calls.insert(2, dict(input_ids=torch.tensor([[3, 4, 640]])))  # (an id past the vocabulary of 64)
    want = generate_alone(model, [c for i, c in enumerate(calls) if i != 2], kw)
    got, counts = _together(GraphedModule(model), model, calls, kw, refused=1)  # (it fails before its turn)
    assert isinstance(got[2], GraphwrapError) and "outside the model's vocabulary" in str(got[2])
    assert all(torch.equal(g, w) for g, w in zip(got[:2] + got[3:], want))
    assert counts["joined_calls"] == 4 and counts["joined_turns"] == 1, counts


def _texts(lengths, masks=True):
    g = torch.Generator().manual_seed(5)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, 60, (1 + i % 2, n), generator=g)
        out.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids)) if masks or i % 3 else dict(input_ids=ids))
    return out


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_text_prompts_of_every_length_join_padded_with_generates_tokens(name):
    model = varied_weights(_model(name))
    kw = dict(max_new_tokens=10, no_repeat_ngram_size=1)
    calls = _texts([6, 14, 9, 3, 11, 7], masks=False)  # (some with a mask, some without)
    kw, want = ending_eos(model, name, calls, kw)
    got, counts = _together(GraphedModule(model), model, calls, kw)
    for i, w in enumerate(want):
        assert torch.equal(got[i], w), (name, i, got[i].tolist(), w.tolist())
    assert counts["joined_calls"] == len(calls) and turns._HONOURS[model] is True, counts


def test_a_model_that_reads_padded_prompts_joins_calls_of_one_length_only(gw_log):
    model = varied_weights(_model("bart"))

    def unmasked(module, args, kwargs):  # (the encoder and the cross-attention see every position)
        kwargs.pop("attention_mask", None)
        return args, kwargs

    model.register_forward_pre_hook(unmasked, with_kwargs=True)
    kw = dict(max_new_tokens=6, no_repeat_ngram_size=1)
    calls = _texts([6, 9, 6, 12])
    want = generate_alone(model, calls, kw)
    gm = GraphedModule(model)
    got, counts = _together(gm, model, calls, kw)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert turns._HONOURS[model] is False and counts["joins_undone"] == 1 and counts["joined_turns"] == 0, counts
    assert "join only calls of their own prompt's length" in gw_log.text
    got, counts = _together(gm, model, calls, kw)  # (now: the two of 6 positions joined, the others alone)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert counts["joined_turns"] == 1 and counts["joined_calls"] == 2, counts


def test_decode_false_keeps_every_callgenerate_alone():
    model = _model("t5")
    gm = GraphedModule(model, decode=False)
    calls = [_inputs("t5", 1, i) for i in range(3)]
    t = turns.turns_of(model)
    hold_turn(t)
    threads = [threading.Thread(target=gm.generate, kwargs=dict(c, max_new_tokens=4)) for c in calls]
    for th in threads:
        th.start()
    release_turn(t, len(calls))
    for th in threads:
        th.join()
    assert t.counts["turns"] == 3 and t.counts["joined_turns"] == 0


# ------------------------------------------------------------------ ids past the vocabulary


@pytest.mark.parametrize("bad", [dict(input_ids=torch.tensor([[3, 64, 5]])), dict(input_ids=torch.tensor([[3, -1]])),
                                 dict(pad_token_id=70), dict(decoder_start_token_id=64),
                                 dict(forced_bos_token_id=100), dict(decoder_input_ids=torch.tensor([[0, 80]]))])
def test_a_call_of_ids_past_the_vocabulary_fails_alone_before_any_forward(bad):
    """The one-call loop's calls (an encoder-decoder's here): on a GPU any of these would be a
    device-side assert ending the CUDA context of every caller."""
    model = _model("t5")
    gm = GraphedModule(model)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *a: forwards.append(1))
    call = dict(dict(input_ids=torch.tensor([[3, 4, 5]]), max_new_tokens=4), **bad)
    with pytest.raises(GraphwrapError, match="outside the model's vocabulary of 64"):
        gm.generate(**call)
    assert not forwards
    hook.remove()
    ended = []
    streamer = type("Streamer", (), {"put": lambda self, v: None, "end": lambda self: ended.append(1)})()
    with pytest.raises(GraphwrapError):
        gm.generate(**call, streamer=streamer)
    assert ended == [1], "its streamer ended: a consumer waiting on it is let go"
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        want = model.generate(input_ids=ids, max_new_tokens=4, eos_token_id=500)  # (an end never made: served)
    assert torch.equal(gm.generate(input_ids=ids, max_new_tokens=4, eos_token_id=500), want)
