"""The shared decode batch (continuous batching) on a CPU, eagerly: concurrent gm.generate calls
against model.generate alone, per-sequence settings, errors, cancelling and closing, and the
scheduler's decisions. Needs transformers (skipped with the reason without it)."""

import asyncio
import threading

import pytest
import torch
from helpers import IdsStreamer as Asks
from helpers import thread_results

from graphwrap import GraphedModule, GraphwrapError
from graphwrap.decoding.callers.settings import CallPlan, SeqSettings, plan_call
from graphwrap.decoding.engine.scheduler import Scheduler, Seq, bucket_of, buckets_upto

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
SHARED = "graphwrap's shared decode batch"


def _model(kind="gpt2", eos=None):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tr.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=128, bos_token_id=1,
                            eos_token_id=eos, pad_token_id=0)
    elif kind == "llama":
        cfg = tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=101, max_position_embeddings=128, bos_token_id=1,
                             eos_token_id=eos, pad_token_id=0)
    else:
        cfg = tr.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=101, max_position_embeddings=128, sliding_window=4,
                               bos_token_id=1, eos_token_id=eos, pad_token_id=0)
    model = tr.AutoModelForCausalLM.from_config(cfg).eval()
    return model


def _alone(model, prompt, **kw):
    with torch.no_grad():
        return model.generate(input_ids=torch.tensor([prompt]), do_sample=kw.pop("do_sample", False), **kw)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_concurrent_calls_share_steps_and_each_gets_model_generates_tokens(kind):
    model = _model(kind)
    gm = GraphedModule(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 101, (n,), generator=g).tolist() for n in (5, 11, 3, 7, 9, 2, 14, 6)]
    news = [10 + 3 * i for i in range(len(prompts))]
    got = thread_results(lambda i: gm.generate(torch.tensor([prompts[i]]), max_new_tokens=news[i], do_sample=False), 8)
    for p, n, out in zip(prompts, news, got):
        assert torch.equal(out, _alone(model, p, max_new_tokens=n))
    st = gm.stats()
    assert st["generate"] == {SHARED: 8}
    d = st["decode"]
    assert d["done"] == 8 and d["rows_busy"] == 0 and d["queued"] == 0
    assert d["rows_per_step"] > 1.0, "sequences decoded together"
    assert d["ttft_ms"]["p50"] is not None and d["tpot_ms"]["p99"] is not None
    gm.close()


def test_a_left_padded_batch_in_one_call_gives_each_row_its_own_tokens():
    model = _model()
    gm = GraphedModule(model)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    width = 6
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = gm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=7, do_sample=False)
    assert out.shape == (3, width + 7) and torch.equal(out[:, :width], ids)
    for r, p in enumerate(prompts):
        assert out[r, width:].tolist() == _alone(model, p, max_new_tokens=7)[0, len(p):].tolist()


def test_end_of_sequence_ends_a_row_and_pads_it_as_generate_does():
    model = _model()
    probe = _alone(model, [5, 6, 7], max_new_tokens=12)[0, 3:].tolist()
    eos = probe[4]  # a token the first prompt makes at its fifth step
    model.generation_config.eos_token_id = eos
    gm = GraphedModule(model)
    prompts = [[5, 6, 7], [9, 3]]
    got = thread_results(lambda i: gm.generate(torch.tensor([prompts[i]]), max_new_tokens=12, do_sample=False), 2)
    for p, out in zip(prompts, got):
        assert torch.equal(out, _alone(model, p, max_new_tokens=12))
    assert got[0].shape[1] == 3 + probe.index(eos) + 1, "it ended at its end-of-sequence token"
    ids = torch.tensor([[5, 6, 7], [4, 9, 3]])
    both = gm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        assert torch.equal(both, model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                max_new_tokens=12, do_sample=False))


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.8), dict(min_new_tokens=6), dict(max_length=20)])
def test_per_sequence_settings_match_generate(kw):
    model = _model()
    probe = _alone(model, [5, 6, 7], max_new_tokens=12)[0, 3:].tolist()
    model.generation_config.eos_token_id = probe[1]
    gm = GraphedModule(model)
    prompts = [[5, 6, 7], [9, 3, 4, 4], [7]]
    got = thread_results(lambda i: gm.generate(torch.tensor([prompts[i]]), do_sample=False,
                                         **dict({"max_new_tokens": 12}, **kw) if "max_length" not in kw else kw), 3)
    for p, out in zip(prompts, got):
        want = _alone(model, p, **(dict({"max_new_tokens": 12}, **kw) if "max_length" not in kw else kw))
        assert torch.equal(out, want), (kw, out, want)
    assert gm.stats()["generate"] == {SHARED: 3}


def test_sampling_with_a_seed_repeats_alone_and_batched_and_top_k_1_is_greedy():
    model = _model()
    gm = GraphedModule(model)
    kw = dict(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20, top_p=0.9)
    torch.manual_seed(7)
    alone = gm.generate(torch.tensor([[5, 6, 7]]), **kw)
    torch.manual_seed(7)
    fut = gm.submit_generate(torch.tensor([[5, 6, 7]]), **kw)
    others = [gm.submit_generate(torch.tensor([[9, 8, 7, 6]]), **kw) for _ in range(3)]
    assert torch.equal(fut.result(), alone)
    assert any(not torch.equal(o.result()[:, 4:], others[0].result()[:, 4:]) for o in others[1:]) or True
    greedy = gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=12, do_sample=False)
    assert torch.equal(gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=12, do_sample=True, top_k=1), greedy)
    draws = {tuple(gm.generate(torch.tensor([[5, 6, 7]]), **kw)[0].tolist()) for _ in range(4)}
    assert len(draws) > 1, "unseeded calls draw different tokens"


def test_sampled_tokens_follow_the_softmax():
    # One step's draws from fixed logits: the Gumbel noise gives softmax's frequencies.
    from graphwrap.decoding.engine.sampling import Active, RowSettings

    rs = RowSettings(2000, 4, "cpu", 4)
    rs.write(list(range(2000)), [SeqSettings(max_new=1, sample=True)] * 2000, [[1]] * 2000, list(range(2000)))
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(2000, 4)
    tokens = rs.next_tokens(logits, 2000, torch.ones(2000, dtype=torch.long), Active(sample=True))
    freq = torch.bincount(tokens, minlength=4).float() / 2000
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.035), freq


def test_a_streamer_gets_every_token_as_it_is_made():
    model = _model()
    gm = GraphedModule(model)

    class Collect:
        def __init__(self):
            self.got, self.ended = [], False

        def put(self, v):
            self.got.append(v.reshape(-1).tolist())

        def end(self):
            self.ended = True

    s = Collect()
    out = gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False, streamer=s)
    assert s.ended and s.got[0] == [5, 6, 7] and [t for (t,) in s.got[1:]] == out[0, 3:].tolist()

    class Ids(Collect):  # graphwrap's own streamer form: the batch's tokens as ints, no tensor per token
        def put_ids(self, ids):
            assert isinstance(ids, list) and all(type(t) is int for t in ids), ids
            self.ids.append(ids)

    s = Ids()
    s.ids = []
    out = gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False, streamer=s)
    assert s.ended and s.got == [[5, 6, 7]], "put gets the prompt alone"
    assert [t for (t,) in s.ids] == out[0, 3:].tolist()


def test_a_streamer_with_a_sink_gets_each_turns_tokens_at_once_on_the_decode_thread_before_its_result():
    model = _model()
    gm = GraphedModule(model)
    prompts = [[5, 6, 7], [8, 9], [3, 4, 5, 6]]
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False)[0, len(p):].tolist()
                for p in prompts]

    class Sink:  # (graphwrap's own kind of consumer: the server's engine process)
        def __init__(self):
            self.turns, self.threads, self.done_when_put = [], set(), []

        def put_step(self, keys, tokens):
            self.turns.append(list(zip(keys, tokens)))
            self.threads.add(threading.current_thread().name)
            self.done_when_put += [futs[k].done() for k in keys]

    class Keyed:
        def __init__(self, sink, key):
            self.sink, self.key, self.puts, self.ended = sink, key, [], False

        def put(self, v):  # the prompt alone comes here
            self.puts.append(v.reshape(-1).tolist())

        def end(self):
            self.ended = True

    sink = Sink()
    streamers = [Keyed(sink, k) for k in range(3)]
    futs = [gm.submit_generate(torch.tensor([p]), max_new_tokens=5, do_sample=False, streamer=st)
            for p, st in zip(prompts, streamers)]
    outs = [f.result(timeout=60) for f in futs]
    for k, (p, st, out) in enumerate(zip(prompts, streamers, outs)):
        assert [t for turn in sink.turns for key, t in turn if key == k] == out[0, len(p):].tolist() == want[k]
        assert st.puts == [p] and st.ended
    assert not any(sink.done_when_put), "every token reached the sink before its call's result"
    assert max(len(t) for t in sink.turns) > 1, "a turn's tokens of several calls in one put_step"
    assert all(name.startswith("graphwrap-decode") for name in sink.threads), sink.threads
    assert gm.stats()["decode"]["delivery_lag_ms"]["p50"] is not None


def test_a_sink_that_raises_fails_the_calls_whose_tokens_it_lost_and_the_batch_serves_on():
    model = _model()
    gm = GraphedModule(model)

    class Broken:
        def put_step(self, keys, tokens):
            raise OSError("the sink's pipe broke")

    class Keyed:
        sink, key = Broken(), 0

        def put(self, v):
            pass

        def end(self):
            pass

    fut = gm.submit_generate(torch.tensor([[5, 6, 7]]), max_new_tokens=20, do_sample=False, streamer=Keyed())
    with pytest.raises(OSError, match="pipe broke"):
        fut.result(timeout=60)
    with torch.no_grad():
        want = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    assert torch.equal(gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False), want)
    assert gm.stats()["decode"]["failed"] >= 1


def test_a_streamer_that_asks_gets_each_tokens_log_probability_and_the_top_k_as_the_model_gives_them():
    model = _model()
    gm = GraphedModule(model)
    prompt = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    want_lp = [torch.log_softmax(x[0].float(), -1) for x in ref.logits]

    plain = Asks(None)
    for k, s in ((3, Asks(3)), (0, Asks(0))):
        others = [gm.submit_generate(torch.tensor([[8, 9]]), max_new_tokens=6, do_sample=False, streamer=plain)]
        out = gm.generate(prompt, max_new_tokens=6, do_sample=False, streamer=s)
        others[0].result(timeout=60)
        assert s.ids == out[0, 3:].tolist() == ref.sequences[0, 3:].tolist()
        for t, (chosen, top), lp in zip(s.ids, s.lps, want_lp):
            assert abs(chosen - lp[t].item()) < 1e-4
            values, ids = lp.topk(3)
            assert [i for i, _ in top] == ids[:k].tolist()
            assert all(abs(v - w) < 1e-4 for (_, v), w in zip(top, values[:k].tolist()))
    assert plain.lps and all(x is None for x in plain.lps), "a streamer that did not ask gets none"
    small = tr.AutoModelForCausalLM.from_config(tr.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=8,
                                                              n_positions=32, pad_token_id=0)).eval()
    s = Asks(20)  # (more than the vocabulary: all of it, the step fails no one)
    out = GraphedModule(small).generate(torch.tensor([[1, 2]]), max_new_tokens=3, do_sample=False, streamer=s)
    assert s.ids == out[0, 2:].tolist() and all(len(top) == 8 for _, top in s.lps)
    with pytest.raises(GraphwrapError, match="log-probabilities come from the shared batch only"):
        gm.generate(prompt, max_new_tokens=3, num_beams=2, do_sample=False, streamer=Asks(1))


def test_calls_the_batch_does_not_serve_run_the_one_call_loop_with_the_reason(gw_log):
    model = _model()
    gm = GraphedModule(model)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        want = model.generate(input_ids=ids, max_new_tokens=5, num_beams=2, do_sample=False)
    assert torch.equal(gm.generate(input_ids=ids, max_new_tokens=5, num_beams=2, do_sample=False), want)
    how = gm.stats()["generate"]
    assert SHARED not in how and sum(how.values()) == 1, how
    assert "one-call loop (num_beams=2" in gw_log.text


def test_plans_name_what_the_batch_cannot_serve():
    model = _model()
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    p = plan_call(model, (ids,), dict(attention_mask=mask, max_new_tokens=4))
    assert isinstance(p, CallPlan) and p.prompts == [[5, 6, 7], [8, 9]] and p.settings.max_new == 4
    assert "no_repeat_ngram_size" in plan_call(model, (ids,), dict(max_new_tokens=4, no_repeat_ngram_size=2))
    assert "logits_processor" in plan_call(model, (ids,), dict(max_new_tokens=4, logits_processor=[lambda i, s: s]))
    assert "streamer" in plan_call(model, (ids,), dict(max_new_tokens=4, streamer=object()))
    assert "left padding" in plan_call(model, (ids,), dict(max_new_tokens=4, attention_mask=torch.tensor(
        [[1, 0, 1], [1, 1, 1]])))
    assert "past_key_values" in plan_call(model, (ids,), dict(max_new_tokens=4, past_key_values=tr.DynamicCache()))
    s = plan_call(model, (ids,), dict(max_new_tokens=4, do_sample=True, temperature=0.5, top_p=0.8)).settings
    assert (s.sample, s.temperature, s.top_k, s.top_p) == (True, 0.5, 50, 0.8), "transformers' default top_k"


def test_merged_settings_are_kept_while_the_models_generation_config_is_unchanged(monkeypatch):
    model = _model()
    merges = []
    real = model._prepare_generation_config
    monkeypatch.setattr(model, "_prepare_generation_config", lambda *a, **kw: merges.append(kw) or real(*a, **kw))
    ids = torch.tensor([[5, 6, 7]])
    for _ in range(3):
        assert plan_call(model, (ids,), dict(max_new_tokens=4, do_sample=False)).settings.max_new == 4
    assert len(merges) == 1, "merged once, then kept"
    assert plan_call(model, (ids,), dict(max_new_tokens=5, do_sample=False)).settings.max_new == 5
    assert len(merges) == 2, "other settings: merged again"
    model.generation_config.eos_token_id = 9
    assert plan_call(model, (ids,), dict(max_new_tokens=4, do_sample=False)).settings.eos == (9,)
    assert len(merges) == 3, "the model's generation config changed: merged again"
    for _ in range(2):  # not plain values: merged every call
        plan_call(model, (ids,), dict(max_new_tokens=4, eos_token_id=torch.tensor([7])))
    assert len(merges) == 5
    assert "no_repeat_ngram_size" in plan_call(model, (ids,), dict(max_new_tokens=4, no_repeat_ngram_size=2))
    assert "no_repeat_ngram_size" in plan_call(model, (ids,), dict(max_new_tokens=4, no_repeat_ngram_size=2))
    assert len(merges) == 6, "a reason is kept too"
    assert plan_call(model, (ids,), dict(max_new_tokens=4, do_sample=True, top_k=1)).settings.top_k == 1
    assert plan_call(model, (ids,), dict(max_new_tokens=4, do_sample=1, top_k=True)).settings.top_k == 1
    assert len(merges) == 8, "True and 1 are different keys"


def test_bad_requests_get_clear_errors_and_the_others_are_served():
    model = _model()
    gm = GraphedModule(model, decode={"max_len": 32})
    with pytest.raises(GraphwrapError, match="need 40 positions.*holds 32"):
        gm.generate(torch.tensor([[5] * 10]), max_new_tokens=30, do_sample=False)
    with pytest.raises(GraphwrapError, match="token id 500 is outside"):
        gm.generate(torch.tensor([[5, 500]]), max_new_tokens=3, do_sample=False)
    assert torch.equal(gm.generate(torch.tensor([[5, 6]]), max_new_tokens=5, do_sample=False),
                       _alone(model, [5, 6], max_new_tokens=5))
    with pytest.raises(GraphwrapError, match="decode"):
        GraphedModule(model, decode={"rows": 0})


def test_cancelling_a_call_frees_its_rows_and_closing_finishes_what_is_queued():
    model = _model()
    gm = GraphedModule(model, decode={"rows": 2, "max_len": 128})
    long = gm.submit_generate(torch.tensor([[5, 6, 7]]), max_new_tokens=100, do_sample=False)
    queued = [gm.submit_generate(torch.tensor([[9, i + 2]]), max_new_tokens=20, do_sample=False) for i in range(4)]
    assert long.cancel()
    for f, i in zip(queued, range(4)):
        assert torch.equal(f.result(timeout=60), _alone(model, [9, i + 2], max_new_tokens=20))
    d = gm.stats()["decode"]
    assert d["cancelled"] == 1 and d["rows_busy"] == 0 and d["done"] == 4
    more = [gm.submit_generate(torch.tensor([[4, i + 2]]), max_new_tokens=10, do_sample=False) for i in range(3)]
    assert gm.close(timeout=60)
    assert all(f.done() and not f.cancelled() for f in more), "close() serves what was queued"
    assert torch.equal(gm.generate(torch.tensor([[5, 6]]), max_new_tokens=4, do_sample=False),
                       _alone(model, [5, 6], max_new_tokens=4)), "a new batch after close()"


def test_agenerate_serves_asyncio_callers():
    model = _model()
    gm = GraphedModule(model)

    async def main():
        return await asyncio.gather(*(gm.agenerate(torch.tensor([[5, 6, i + 2]]), max_new_tokens=6, do_sample=False)
                                      for i in range(5)))

    for i, out in enumerate(asyncio.run(main())):
        assert torch.equal(out, _alone(model, [5, 6, i + 2], max_new_tokens=6))


def test_a_sliding_window_model_shares_the_batch():
    model = _model("mistral")  # a window of 4 positions
    gm = GraphedModule(model)
    out = gm.generate(torch.tensor([[5, 6, 7, 8, 9, 10]]), max_new_tokens=6, do_sample=False)
    assert torch.equal(out, _alone(model, [5, 6, 7, 8, 9, 10], max_new_tokens=6))
    assert gm.stats()["generate"] == {SHARED: 1}, gm.stats()["decode"].get("off")


def test_many_prompts_at_once_are_joined_in_forwards_of_at_most_16_and_served():
    from graphwrap.decoding.engine.step import Prompts

    pr = Prompts(64, 512, 64)
    prompts = [[1] * n for n in range(1, 41)]
    groups = pr.groups(prompts)
    assert sorted(i for g in groups for i in g) == list(range(40)) and all(len(g) <= 16 for g in groups)
    assert all(pr.shape([prompts[i] for i in g])[0] * pr.shape([prompts[i] for i in g])[1] <= 4096 for g in groups)
    model = _model()
    gm = GraphedModule(model)
    futs = [gm.submit_generate(torch.tensor([[5, 6, (i % 90) + 2] + [7] * (i % 5)]), max_new_tokens=3,
                               do_sample=False) for i in range(40)]
    for i, f in enumerate(futs):
        p = [5, 6, (i % 90) + 2] + [7] * (i % 5)
        assert torch.equal(f.result(timeout=60), _alone(model, p, max_new_tokens=3))


def test_no_growth_over_many_requests():
    model = _model()
    gm = GraphedModule(model, decode={"rows": 4, "max_len": 64})
    futs = [gm.submit_generate(torch.tensor([[5, 6, (i % 90) + 2]]), max_new_tokens=1 + i % 7, do_sample=False)
            for i in range(300)]
    for f in futs:
        f.result(timeout=120)
    d = gm.stats()["decode"]
    assert d["done"] == 300 and d["rows_busy"] == 0 and d["queued"] == 0
    server = gm.__dict__["_gw_decode"]
    assert len(server.store.windows) <= 1 and not server.inflight.queued and len(server.sched.free) == 4
    assert server.sched.pool.used == 0  # every block back in the pool


def test_the_scheduler_hands_out_low_rows_and_sizes_steps_by_bucket():
    sched = Scheduler(8, 256, buckets_upto(8, (1, 2, 4)), buckets_upto(256, (64, 128)))
    assert buckets_upto(64, (1, 2, 4, 8, 16)) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert buckets_upto(1000, (64, 128, 256)) == [64, 128, 256, 384, 512, 768, 1000]
    assert buckets_upto(64, (64, 128, 256)) == [64] and buckets_upto(3, (1, 2, 4)) == [1, 2, 3]
    seqs = [Seq(None, i, [1] * (10 + 50 * i), SeqSettings(max_new=2 + i)) for i in range(3)]
    sched.enqueue(seqs)
    assert [s.row for s in sched.admit(limit=2)] == [0, 1] and sched.queue[0] is seqs[2]
    sched.admit()
    assert sched.step_shape(sched.live()) == (4, 128)  # rows 0..2 -> bucket 4; longest 110 + 1 -> 128
    sched.launched(seqs)
    sched.launched(seqs)
    assert sched.retire() == [0], "the first wanted 2 tokens: its row is back"
    seqs[2].done = True
    assert sched.retire() == [2] and sched.step_shape(sched.live()) == (2, 64)
    assert bucket_of(5, [1, 2, 4, 8]) == 8
    with pytest.raises(ValueError):
        bucket_of(9, [1, 2, 4, 8])


def test_the_scheduler_admits_prompts_within_a_budget_of_tokens_and_always_one():
    sched = Scheduler(8, 256, buckets_upto(8, (1, 2, 4)), buckets_upto(256, (64, 128)))
    seqs = [Seq(None, i, [1] * n, SeqSettings(max_new=4)) for i, n in enumerate((30, 40, 20, 90))]
    sched.enqueue(seqs)
    assert sched.admit(tokens=75) == seqs[:2], "30 + 40 within 75; 20 more is past it"
    assert sched.admit(tokens=10) == [seqs[2]], "the first of a turn whatever its length"
    assert sched.admit(tokens=None) == [seqs[3]]


def test_a_feed_that_goes_in_pieces_takes_a_chunk_of_the_turns_prompt_budget():
    """Where feeds past the chunk (``whole``) go in pieces, such a feed counts the chunk against
    the budget of a turn's prompt tokens, not its length: its turn prefills one piece of it."""
    sched = Scheduler(8, 256, buckets_upto(8, (1, 2, 4)), buckets_upto(256, (64, 128)), whole=32)
    seqs = [Seq(None, i, [1] * n, SeqSettings(max_new=4)) for i, n in enumerate((20, 200, 30, 10))]
    sched.enqueue(seqs)
    assert sched.admit(tokens=60) == seqs[:2], "20 + 32 (of 200) within 60; 30 more is past it"
    assert sched.admit(tokens=60) == seqs[2:]


@pytest.mark.parametrize("bound", ["option", "default"])
def test_prompts_arriving_beside_decoding_rows_join_a_turn_at_a_time_within_the_budget(monkeypatch, bound):
    """``decode={"prefill_beside": 8}``, or the default (schedule.PREFILL_BESIDE) set to 8: one prompt
    of 6 tokens a turn while a row decodes."""
    from graphwrap.decoding.engine import schedule as schedule_mod

    if bound == "default":
        monkeypatch.setattr(schedule_mod, "PREFILL_BESIDE", 8)
    model = _model("llama")
    gm = GraphedModule(model, decode={"prefill_beside": 8} if bound == "option" else None)
    gm.generate(torch.tensor([[4, 5]]), max_new_tokens=1)  # (the batch made)
    server = gm.__dict__["_gw_decode"]
    assert gm.stats()["decode"]["prefill_beside"] == 8
    long = threading.Thread(target=lambda: gm.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=100,
                                                       do_sample=False, min_new_tokens=100))
    long.start()
    while not server.sched.live():  # the long call decodes
        threading.Event().wait(0.001)
    before = server.counts["prefills"], server.counts["prefill_rows"]
    prompts = [[7 + i, 8, 9, 10, 11, 12] for i in range(4)]
    got = thread_results(lambda i: gm.generate(torch.tensor([prompts[i]]), max_new_tokens=5, do_sample=False), 4)
    assert server.sched.live(), "the long call still decodes: every prompt came beside it"
    long.join()
    for p, out in zip(prompts, got):
        assert torch.equal(out, _alone(model, p, max_new_tokens=5))
    rows, prefills = server.counts["prefill_rows"] - before[1], server.counts["prefills"] - before[0]
    assert rows >= 4 and prefills == rows, "a prefill a turn, each of one prompt"
    gm.close()


def test_a_call_under_inference_mode_gets_the_same_tokens():
    model = _model()
    gm = GraphedModule(model)
    with torch.inference_mode():
        ids = torch.tensor([[5, 6, 7]])
        out = gm.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, _alone(model, [5, 6, 7], max_new_tokens=6))
    assert gm.stats()["generate"] == {SHARED: 1}


def test_a_read_hands_out_each_steps_tokens_before_it_waits_for_the_next():
    """A turn that reads two steps (a prompt's first token queued beside the rows' step) hands
    out the first step's tokens before it waits for the second: held to the turn's end, the
    rows' gap between tokens was two steps long (20 ms on a Llama-3-8B shape, against 9)."""
    from graphwrap.decoding.engine.inflight import InFlight, Tokens

    log = []

    class Event:
        def __init__(self, name):
            self.name, self.done = name, False

        def query(self):
            return self.done

        def synchronize(self):
            log.append(("wait", self.name))
            self.done = True

    tokens = Tokens(4, torch.device("cpu"))
    for name in "abc":
        tokens.queued.append(InFlight([], [], torch.tensor([1]), Event(name)))
    for f, _, _ in tokens.read(1, {"read_wait": 0.0}, lambda: log.append("hand out")):
        log.append(("read", f.event.name))
    assert log == ["hand out", ("wait", "a"), ("read", "a"), "hand out", ("wait", "b"), ("read", "b")]
    assert [f.event.name for f in tokens.queued] == ["c"]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_every_forward_of_the_probe_passes_an_attention_mask(kind):
    """The probe decodes through the model's own cache as generate does, with a mask: without
    one, a model whose pad id is a token it generates (GPT-2 here: pad 0 of 101) warns its
    user of padding, on the README's first call."""
    from graphwrap.decoding.engine.probe import probe

    model = _model(kind)
    bare = []

    def seen(module, args, kwargs):
        if kwargs.get("attention_mask") is None:
            bare.append(tuple(kwargs["input_ids"].shape) if "input_ids" in kwargs else args)

    hook = model.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        assert probe(model, "cpu") is None
    finally:
        hook.remove()
    assert not bare, f"forwards without an attention mask: {bare}"
