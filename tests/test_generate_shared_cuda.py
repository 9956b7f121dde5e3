"""The shared decode batch on a GPU: concurrent gm.generate calls whose steps replay graphs,
against model.generate alone (fp32, TF32 off: equal), sampling seeded alike alone and batched,
errors, cancelling, compile=True."""

import threading
import time

import pytest
import torch
from helpers import IdsStreamer as Asks
from helpers import thread_results

from graphwrap import GraphedModule, GraphwrapError

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fp32_exact")]
DEV = "cuda"
tr = pytest.importorskip("transformers", reason="needs transformers, which no extra installs: pip install transformers")
SHARED = "graphwrap's shared decode batch"


def _model(kind="gpt2"):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tr.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=512, bos_token_id=1,
                            eos_token_id=None, pad_token_id=0)
    else:
        cfg = tr.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512, bos_token_id=1,
                             eos_token_id=None, pad_token_id=0)
    return tr.AutoModelForCausalLM.from_config(cfg).to(DEV).eval()


def _requests(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 60, (n,), generator=g).tolist()
    news = torch.randint(5, 40, (n,), generator=g).tolist()
    return [(torch.randint(2, 1000, (1, p), generator=g).to(DEV), k) for p, k in zip(lens, news)]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_32_concurrent_calls_replay_shared_steps_and_get_generates_tokens(kind):
    model = _model(kind)
    gm = GraphedModule(model)
    reqs = _requests(32)
    for _ in range(2):  # the second pass replays what the first captured (beside it)
        got = thread_results(lambda i: gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1], do_sample=False), 32)
        assert gm.__dict__["_gw_decode"].captures.finish(120)
    with torch.no_grad():
        for (ids, k), out in zip(reqs, got):
            assert torch.equal(out, model.generate(input_ids=ids, max_new_tokens=k, do_sample=False))
    st = gm.stats()
    d = st["decode"]
    assert st["generate"] == {SHARED: 64} and d["rows_per_step"] > 4 and d["rows_busy"] == 0
    step = d["step"]
    graphed = [k for k in step["keys"] if k["status"] == "graphed"]
    assert graphed and not step["eager_calls"], (step["keys"], step["eager_calls"])
    replays = sum(b["replays"] for k in step["keys"] for b in k["buckets"].values())
    assert replays >= d["steps"] // 2, (replays, d["steps"])
    # The steps ran graphwrap's attention (the paged pool read in place, by default on a GPU; and
    # Llama's grouped heads folded), which no step saw as a change of the module (each would
    # cost a full look at it), and the model's own setting is back.
    server = gm.__dict__["_gw_decode"]
    assert server.cache.paged and server.store.kernel, "the default on a GPU with Triton"
    assert server.fold.config is not None
    assert not step["module_changes"], step["module_changes"]
    assert model.config._attn_implementation == "sdpa"
    gm.close()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_first_burst_is_served_while_its_shapes_are_captured_beside_it(monkeypatch, kind):
    """A fresh batch: its shapes are captured on the capturing thread (never the decode thread)
    while the decode thread serves each forward eagerly or by a larger graph; every request's
    tokens are model.generate's, during the captures and after them."""
    from graphwrap.capture import capturer

    where, capture_into = [], capturer.capture_into

    def noted(*a, **k):
        where.append(threading.current_thread().name)
        return capture_into(*a, **k)

    monkeypatch.setattr(capturer, "capture_into", noted)
    model = _model(kind)
    gm = GraphedModule(model)
    reqs = _requests(32, seed=7)
    with torch.no_grad():
        want = [model.generate(input_ids=ids, max_new_tokens=k, do_sample=False) for ids, k in reqs]
    for _ in range(2):
        got = thread_results(lambda i: gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1], do_sample=False),
                             32)
        for w, out in zip(want, got):
            assert torch.equal(out, w)
    server = gm.__dict__["_gw_decode"]
    d = gm.stats()["decode"]
    assert where and set(where) == {"graphwrap-decode-capture"}, set(where)
    assert d["capture_failed"] == {} and any(s[0] == "step" for s in d["shapes"])
    assert d["captures"]["done"] >= len(d["shapes"])
    # The cache's table was loaded into the twins whose graphs served steps.
    assert any(t.seen >= 0 for s, t in server.twins.items() if s[0] == "step")
    gm.close()
    assert not server.captures.thread.is_alive()


def test_the_capturing_thread_makes_its_twins_and_inputs_on_its_own_stream(monkeypatch):
    """Its captures run on streams ordered after the capturing thread's stream. A twin's table
    or a capture's ids made on the default stream were read unordered, possibly before they were
    written: the likely cause of an embedding's index out of bounds, on 48 rows while the step of
    48 rows was captured, beside a 7,900-token prompt on an H200 (2026-11-29)."""
    from graphwrap.decoding.cache.pages import PagedStore
    from graphwrap.decoding.engine.captures import Captures

    seen, twin, inputs = [], PagedStore.twin, Captures._inputs

    def noted(f):
        def run(*a, **k):
            seen.append((threading.current_thread().name, torch.cuda.current_stream().cuda_stream))
            return f(*a, **k)
        return run

    monkeypatch.setattr(PagedStore, "twin", noted(twin))
    monkeypatch.setattr(Captures, "_inputs", noted(inputs))
    model = _model("llama")
    gm = GraphedModule(model)
    reqs = _requests(8, seed=3)
    thread_results(lambda i: gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1], do_sample=False), 8)
    server = gm.__dict__["_gw_decode"]
    assert server.captures.finish(120)
    own = server.captures.stream.cuda_stream
    assert seen and {s for _, s in seen} == {own}, (seen, own)
    assert {t for t, _ in seen} == {"graphwrap-decode-capture"}
    gm.close()


def test_sampling_with_a_seed_repeats_alone_and_in_a_full_batch():
    model = _model()
    gm = GraphedModule(model)
    kw = dict(max_new_tokens=20, do_sample=True, temperature=0.8, top_k=40, top_p=0.95)
    ids = torch.randint(2, 1000, (1, 9), device=DEV)
    torch.manual_seed(3)
    alone = gm.generate(input_ids=ids, **kw)
    others = [gm.submit_generate(input_ids=r, **kw) for r, _ in _requests(16, seed=1)]
    torch.manual_seed(3)
    batched = gm.submit_generate(input_ids=ids, **kw)
    assert torch.equal(batched.result(timeout=120), alone)
    for f in others:
        f.result(timeout=120)


def test_a_bad_request_fails_alone_and_cancelling_frees_rows():
    model = _model()
    gm = GraphedModule(model, decode={"rows": 8, "max_len": 256})
    reqs = _requests(12, seed=2)
    futs = [gm.submit_generate(input_ids=ids, max_new_tokens=k, do_sample=False) for ids, k in reqs]
    with pytest.raises(GraphwrapError, match="outside the model's vocabulary"):
        gm.generate(input_ids=torch.tensor([[5, 100000]], device=DEV), max_new_tokens=3)
    with pytest.raises(GraphwrapError, match="positions of the decode cache"):
        gm.generate(input_ids=torch.randint(2, 1000, (1, 200), device=DEV), max_new_tokens=100)
    long = gm.submit_generate(input_ids=reqs[0][0], max_new_tokens=200, do_sample=False)
    assert long.cancel()
    with torch.no_grad():
        for (ids, k), f in zip(reqs, futs):
            assert torch.equal(f.result(timeout=120), model.generate(input_ids=ids, max_new_tokens=k, do_sample=False))
    assert gm.close(timeout=60)
    assert gm.stats().get("decode") is None or gm.stats()["decode"]["rows_busy"] == 0


def test_a_lone_call_cancelled_mid_stream_gives_its_row_and_blocks_back_without_another_call():
    """The batch was idle but for the cancelled call: its row and blocks come back at once, not
    when the next call arrives (the decode thread used to wait with them held where the GPU had
    handed every token out)."""
    gm = GraphedModule(_model(), decode={"rows": 8})
    gm.generate(input_ids=torch.tensor([[5, 6]], device=DEV), max_new_tokens=2)  # the batch made

    class CancelAt:
        future = None
        n = 0

        def put(self, value):
            self.n += 1
            if self.n == 4 and self.future is not None:
                self.future.cancel()

        def end(self):
            pass

    streamer = CancelAt()
    streamer.future = gm.submit_generate(input_ids=torch.tensor([[5, 6, 7]], device=DEV), max_new_tokens=500,
                                         streamer=streamer)
    deadline = time.monotonic() + 10
    while True:
        d = gm.stats()["decode"]
        if d["cancelled"] == 1 and d["rows_busy"] == 0 and d["cache_blocks"]["used"] == 0:
            break
        assert time.monotonic() < deadline, d
        time.sleep(0.01)
    assert streamer.future.cancelled() and d["done"] == 1
    gm.close()


def test_compile_true_serves_the_shared_batch_with_plain_graphs_first_then_compiled_steps():
    """compile=True: the first calls are served by plain graphs (captured in a moment), each
    shape's compiled graph replaces its plain one once Inductor has compiled it beside the
    decode thread (graphwrap/decoding/engine/captures.py); tokens as model.generate's both times."""
    model = _model()
    gm = GraphedModule(model, compile=True)
    reqs = _requests(8, seed=4)
    with torch.no_grad():
        want = [model.generate(input_ids=ids, max_new_tokens=k, do_sample=False) for ids, k in reqs]

    def engines_replays():
        d = gm.stats()["decode"]["compiled_engines"]
        return [b for e in d.values() for k in e["keys"] for b in k["buckets"].values()]

    for i in range(2):
        got = thread_results(lambda i: gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1],
                                                   do_sample=False), 8)
        same = sum(torch.equal(out, w) for out, w in zip(got, want))
        assert same >= 7, f"{same} of 8 equal (Inductor's kernels round differently: at most one near tie)"
        if i == 0:
            d = gm.stats()["decode"]
            assert d["shapes"] and d["capture_failed"] == {}, "plain graphs served the first calls"
            assert gm.__dict__["_gw_decode"].captures.finish(600)
            d = gm.stats()["decode"]
            assert d["captures"]["compiled"] and set(d["captures"]["compiled"]) <= set(d["shapes"]), d["captures"]
            # (a kind whose forward Inductor does not serve, one that writes module buffers say,
            # captures its plain forward in the compiled engine too: not every graph there is compiled)
            engines = gm.stats()["decode"]["compiled_engines"]
            assert any(b["compiled"] for b in engines_replays()), [
                (kind, e["compile"], [(k["key"][:40], p, b["compiled"], b["graphs"]) for k in e["keys"]
                                      for p, b in k["buckets"].items()]) for kind, e in engines.items()]
            before = sum(b["replays"] for b in engines_replays())
    assert sum(b["replays"] for b in engines_replays()) > before, "the compiled graphs served the second pass"
    assert gm.stats()["decode"]["done"] == 16
    gm.close()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_log_probabilities_asked_by_a_streamer_are_the_model_s_beside_replayed_steps(kind):
    """Steps replayed from graphs, 16 calls at once, half of whose streamers ask for
    log-probabilities: each token's and its step's top 3 are the model's own (its logits'
    log-softmax, fp32), and the calls that did not ask get none."""
    model = _model(kind)
    gm = GraphedModule(model)
    reqs = _requests(16, seed=3)

    for _ in range(2):  # (the second pass replays what the first captured)
        streamers = [Asks(3 if i % 2 == 0 else None) for i in range(16)]
        thread_results(lambda i: gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1], do_sample=False,
                                             streamer=streamers[i]), 16)
        assert gm.__dict__["_gw_decode"].captures.finish(120)
    with torch.no_grad():
        for i, ((ids, k), s) in enumerate(zip(reqs, streamers)):
            ref = model.generate(input_ids=ids, max_new_tokens=k, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            assert s.ids == ref.sequences[0, ids.shape[1]:].tolist()
            if i % 2:
                assert all(x is None for x in s.lps)
                continue
            for t, (chosen, top), logits in zip(s.ids, s.lps, ref.logits, strict=True):
                lp = torch.log_softmax(logits[0].float(), -1)
                assert abs(chosen - lp[t].item()) < 1e-3
                assert [j for j, _ in top] == lp.topk(3).indices.tolist()
    replays = sum(b["replays"] for k in gm.stats()["decode"]["step"]["keys"] for b in k["buckets"].values())
    assert replays > 0
