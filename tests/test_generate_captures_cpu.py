"""Shapes of the shared batch captured on a thread of their own while the decode thread serves:
which shape serves a forward and how, the twin of the paged cache a capture runs over, and
greedy tokens against model.generate alone with the engines on the CPU stand-in for CUDA
graphs (a replay recomputes the forward over the twin's inputs, as a graph would over its
addresses). Needs transformers (skipped with the reason without it)."""

import contextlib
import threading
import time

import pytest
import torch
from helpers import CpuBackend, thread_results

from graphwrap import GraphedModule, GraphwrapError
from graphwrap.decoding.cache.pages import PagedStore
from graphwrap.decoding.cache.pool import BLOCK, scratch_blocks
from graphwrap.decoding.engine.captures import AHEAD, Captures
from graphwrap.decoding.engine.shapes import CAPTURE_AFTER, COVERED, EAGER, GRAPH, INLINE, NEEDED, Shapes

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")


# ------------------------------------------------------------------ which shape, and how

def test_without_graphs_every_shape_is_its_own_and_goes_to_the_engine():
    shapes = Shapes(graphs=False)
    assert shapes.pick(("step", 4, 64)) == (("step", 4, 64), INLINE)


def test_inline_captures_wait_for_a_covered_shape_to_be_wanted_often():
    shapes = Shapes(graphs=True)
    assert shapes.pick(("step", 8, 128)) == (("step", 8, 128), INLINE), "nothing covers it: captured at once"
    for _ in range(CAPTURE_AFTER - 1):
        assert shapes.pick(("step", 4, 64)) == (("step", 8, 128), INLINE)
    assert shapes.pick(("step", 4, 64)) == (("step", 4, 64), INLINE)
    assert shapes.covered["step"] == CAPTURE_AFTER - 1


def test_beside_the_decode_thread_a_shape_is_asked_for_once_and_served_eagerly_or_larger_meanwhile():
    asked = []
    shapes = Shapes(graphs=True, want=lambda shape, queue: asked.append((shape, queue)))
    assert shapes.pick(("step", 4, 64)) == (("step", 4, 64), EAGER)
    assert shapes.pick(("step", 4, 64)) == (("step", 4, 64), EAGER)
    assert asked == [(("step", 4, 64), NEEDED)] and shapes.eager["step"] == 2
    shapes.captured(("step", 8, 64))  # (reported by the capturing thread)
    shapes.captured(("prefill", 4, 64), "it failed")
    assert shapes.pick(("step", 4, 64)) == (("step", 8, 64), GRAPH), "a larger graph serves it meanwhile"
    assert shapes.pick(("prefill", 2, 32)) == (("prefill", 2, 32), EAGER), "a failed capture serves nothing"
    assert shapes.failed == {("prefill", 4, 64): "it failed"}
    for _ in range(CAPTURE_AFTER - 1):  # a larger graph holds it: asked for once it is wanted often
        assert shapes.pick(("step", 2, 64)) == (("step", 8, 64), GRAPH)
    assert asked == [(("step", 4, 64), NEEDED), (("prefill", 2, 32), NEEDED)]
    assert shapes.pick(("step", 2, 64)) == (("step", 8, 64), GRAPH)
    shapes.captured(("step", 4, 64))
    assert shapes.pick(("step", 4, 64)) == (("step", 4, 64), GRAPH)
    assert asked == [(("step", 4, 64), NEEDED), (("prefill", 2, 32), NEEDED), (("step", 2, 64), COVERED)]


# ------------------------------------------------------------------ the twin of the cache

def _store(rows=20, kernel=False):
    store = PagedStore(rows, 64, "cpu", BLOCK, scratch_blocks(rows, BLOCK) + 12, kernel=kernel)
    store.allocate([torch.zeros(1, 2, 1, 8)], [torch.zeros(1, 2, 1, 8)])
    return store


def test_a_twin_points_every_row_at_the_capture_blocks_one_position_each():
    store = _store(rows=20)
    twin = store.twin()
    first = 21  # after the 20 rows' scratch blocks and the padding prompts' one
    spots = {(int(twin.table[r, 0]), int(twin.lengths[r])) for r in range(21)}
    assert len(spots) == 21, "no two rows write the same position"
    assert all(first <= b < scratch_blocks(20, BLOCK) for b, _ in spots), "only capture blocks, never a row's"
    assert all((twin.table[r] == twin.table[r, 0]).all() for r in range(21))
    assert twin.slots.eq(store.scratch).all() and twin.live.eq(1).all()
    assert twin.keys[0] is store.keys[0], "the same pools"


def test_a_piece_twin_writes_only_the_pieces_capture_blocks():
    from graphwrap.decoding.cache.pool import PIECE, blocks_for

    store = PagedStore(20, 256, "cpu", BLOCK, scratch_blocks(20, BLOCK) + 12)
    store.allocate([torch.zeros(1, 2, 1, 8)], [torch.zeros(1, 2, 1, 8)])
    twin = store.piece_twin(PIECE)
    first = 21 + blocks_for(21, BLOCK)  # after the rows' scratch blocks and the steps' capture blocks
    own = blocks_for(PIECE, BLOCK)
    line = twin.table[0].tolist()
    assert line[:own] == list(range(first, first + own)), "the piece's positions in blocks of their own"
    assert set(line) == set(range(first, first + own)) and first + own <= scratch_blocks(20, BLOCK)
    assert store.table[0].tolist() == [0] * store.per_row, "the cache's own table untouched"
    window = twin.piece_window(PIECE, 256)
    twin.at.copy_(torch.tensor([0, PIECE, 0]))
    before = store.keys[0].clone()
    k = torch.randn(1, 2, PIECE, 8)
    window.layers[0].update(k, k.clone())
    changed = (store.keys[0] != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed and set(changed) <= set(range(first, first + own))


def test_a_twin_loads_the_cache_metadata_and_copies_the_table_only_when_it_changed():
    store = _store(rows=4)
    twin = store.twin()
    store.assign([1], [[7, 9]])
    store.lengths[1], store.live[1] = 20, 1
    store.load(twin)
    assert torch.equal(twin.table, store.table) and torch.equal(twin.lv, store.lv)
    twin.table[1, 0] = 3  # (what a stale copy would keep)
    store.load(twin)
    assert int(twin.table[1, 0]) == 3, "unchanged table: not copied again"
    store.extend([1], [2], [11])
    store.load(twin)
    assert twin.table[1].tolist()[:3] == [7, 9, 11]
    twin.lengths[1] += 1
    store.save(twin)
    assert int(store.lengths[1]) == 21


# ------------------------------------------------------------------ served beside captures

def _model(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tr.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=256, bos_token_id=1,
                            eos_token_id=None, pad_token_id=0)
    else:
        cfg = tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=101, max_position_embeddings=256, bos_token_id=1,
                             eos_token_id=None, pad_token_id=0)
    return tr.AutoModelForCausalLM.from_config(cfg).eval()


def _alone(model, prompt, n):
    with torch.no_grad():
        return model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=n)


def _captured_beside(model, compile=None, **decode):
    """A GraphedModule whose batch (made here) captures shapes beside its decode thread, its
    engines on the CPU stand-in for CUDA graphs: ``(gm, server)``. With ``compile``, the engines
    of its compiled graphs are stand-ins too, which compile nothing (Inductor is not asked)."""
    gm = GraphedModule(model, decode=decode, compile=compile)
    gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)  # makes the batch
    server = gm.__dict__["_gw_decode"]
    for engine in (server.engine, server.prefill_engine, server.piece_engine, *server.compiled_engines.values()):
        engine.backend, engine.where = CpuBackend(), None
    for engine in server.compiled_engines.values():
        engine.compile_opts = None
    server.start_captures()
    return gm, server


def _twice_alike(gm, server, model, prompts, news):
    """Every prompt from a thread of its own, twice (the second time over what the first
    captured), each time with model.generate's tokens alone; the batch idle after each."""
    for _ in range(2):
        got = thread_results(lambda i: gm.generate(torch.tensor([prompts[i]]), max_new_tokens=news[i],
                                                   do_sample=False), len(prompts))
        for p, n, out in zip(prompts, news, got):
            assert torch.equal(out, _alone(model, p, n))
        _idle(server)


def _idle(server, timeout=60.0):
    assert server.captures.finish(timeout) and not server.captures.queued()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tokens_are_the_models_while_shapes_are_captured_beside_the_decode_thread_and_after(kind):
    model = _model(kind)
    gm, server = _captured_beside(model, rows=8)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 101, (n,), generator=g).tolist() for n in (5, 11, 3, 14, 9, 2, 13, 6, 8, 12)]
    news = [6 + 3 * (i % 5) for i in range(len(prompts))]
    _twice_alike(gm, server, model, prompts, news)  # (first with shapes captured meanwhile, then served by them)
    d = gm.stats()["decode"]
    assert d["eager_forwards"].get("step", 0) > 0, "steps ran eagerly while their shapes were captured"
    assert any(s[0] == "step" for s in d["shapes"]) and any(s[0] == "prefill" for s in d["shapes"])
    assert d["capture_failed"] == {} and d["captures"]["done"] == len(server.twins)
    assert sum(b["replays"] for k in d["step"]["keys"] for b in k["buckets"].values()) > 0
    twins = list(server.twins.values())
    assert all(t.base is server.store for t in twins) and len({id(t.table) for t in twins}) == len(twins)
    gm.close()
    assert not server.captures.thread.is_alive(), "closing the batch ends its capturing thread"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_long_prompts_pieces_are_captured_beside_and_then_replayed_with_the_models_tokens(monkeypatch, kind):
    """Pieces of a long prompt (8 positions here) go to graphs of their (width, span) shape,
    captured over a twin whose row writes only the piece's capture blocks, then replayed over the
    cache's own table (the piece's place read from the device); tokens as model.generate's."""
    from graphwrap.decoding.engine import pieces as pieces_mod
    from graphwrap.decoding.engine import server as server_mod

    monkeypatch.setattr(server_mod, "CHUNK", 8)
    monkeypatch.setattr(pieces_mod, "WHOLE", 0)  # (these long prompts go in pieces, found alone or not)
    model = _model(kind)
    gm, server = _captured_beside(model, rows=4)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 101, (n,), generator=g).tolist() for n in (30, 4, 21, 9, 17)]
    news = [7, 30, 9, 12, 5]
    _twice_alike(gm, server, model, prompts, news)  # (first while the pieces' shapes are captured)
    d = gm.stats()["decode"]
    pieces = {s for s in d["shapes"] if s[0] == "piece"}
    assert pieces and all(w == 8 for _, w, _ in pieces), d["shapes"]
    assert d["capture_failed"] == {}
    replays = sum(b["replays"] for k in server.piece_engine.stats()["keys"] for b in k["buckets"].values())
    assert replays > 0, "pieces replayed"
    gm.close()


def test_a_capture_that_fails_leaves_its_shape_to_eager_forwards_and_says_why(caplog):
    model = _model("gpt2")
    gm, server = _captured_beside(model, rows=4)
    def broken(*a, **k):
        raise RuntimeError("no capture today")

    server.captures._capture = broken
    out = gm.generate(torch.tensor([[9, 8, 7, 6]]), max_new_tokens=12, do_sample=False)
    assert torch.equal(out, _alone(model, [9, 8, 7, 6], 12))
    _idle(server)
    d = gm.stats()["decode"]
    assert d["capture_failed"] and all("no capture today" in why for why in d["capture_failed"].values())
    assert d["eager_forwards"]["step"] >= 11 and d["shapes"] == []
    assert "no graph for the shared batch" in caplog.text
    gm.close()


def test_captures_go_needed_first_then_queued_ahead_then_covered():
    order, go = [], threading.Event()

    class Server:
        device = torch.device("cpu")
        shapes = Shapes()
        compiled_engines = {}

    caps = Captures(Server())

    def capture(shape):
        go.wait(10)
        order.append(shape)

    caps._capture = capture
    caps.want(("step", 64, 1024), AHEAD)
    time.sleep(0.05)
    assert caps.running is None, "no capture while no call is in flight"
    caps.calls(+1)  # a call: the first is taken at once, held until the others are queued
    while caps.queued() != [("step", 64, 1024)] or caps.running is None:
        time.sleep(0.001)
    caps.want(("step", 2, 1024), COVERED)
    caps.want(("step", 1, 1024), AHEAD)
    caps.want(("prefill", 4, 64), NEEDED)
    caps.want(("prefill", 4, 64), NEEDED)  # once
    caps.want(("prefill", 1, 16), NEEDED)
    caps.want(("piece", 8, 64), COVERED)
    caps.want(("mixed", 8, 8), COVERED)
    caps.want(("mixed", 8, 8), NEEDED)  # (queued ahead of need, then needed: it moves up)
    caps.want(("step", 1, 1024), COVERED)  # (never down)
    go.set()
    assert caps.finish(10)
    assert order == [("step", 64, 1024), ("prefill", 4, 64), ("prefill", 1, 16), ("mixed", 8, 8), ("step", 1, 1024),
                     ("step", 2, 1024), ("piece", 8, 64)]
    caps.calls(-1)
    assert caps.stop(10) and not caps.thread.is_alive()
    caps.want(("step", 4, 1024))
    assert caps.queued() == [], "a stopped thread takes nothing more"


def test_with_compile_each_shape_captured_plain_is_compiled_after_every_plain_capture_queued():
    """compile=: a shape's compiled graph is queued once its plain graph serves (not where that
    failed, nor for a kind without a compiled engine), behind every plain capture."""
    order = []

    class Server:
        device = torch.device("cpu")
        shapes = Shapes()
        compiled_engines = {"step": None, "prefill": None}

    caps = Captures(Server())
    caps._capture = lambda shape: order.append(shape) or ("it failed" if shape[1] == 3 else None)
    caps._compile = lambda shape: order.append(("compiled", shape))
    for shape in (("step", 4, 64), ("step", 3, 64), ("piece", 8, 64), ("prefill", 2, 16)):
        caps.want(shape, AHEAD)
    caps.want(("step", 8, 64), COVERED)
    assert caps.finish(10)
    assert order == [("step", 4, 64), ("step", 3, 64), ("piece", 8, 64), ("prefill", 2, 16), ("step", 8, 64),
                     ("compiled", ("step", 4, 64)), ("compiled", ("prefill", 2, 16)), ("compiled", ("step", 8, 64))]
    assert caps.stop(10)


def test_with_compile_plain_graphs_serve_first_then_compiled_ones_replace_them_with_the_models_tokens():
    """compile=: each shape is served by a plain graph first, then by the graph of its compiled
    engine, captured over a twin of its own (the stand-ins compile nothing: what is tested is
    the order and the hand-over); tokens as model.generate's throughout, the second pass under
    inference_mode."""
    model = _model("gpt2")
    gm, server = _captured_beside(model, compile=True, rows=4)
    assert set(server.compiled_engines) == {"step", "prefill", "piece"}
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, 101, (n,), generator=g).tolist() for n in (5, 11, 3, 7)]
    news = [9, 6, 12, 8]

    def replays():
        d = gm.stats()["decode"]
        return sum(b["replays"] for e in d["compiled_engines"].values() for k in e["keys"] for b in k["buckets"].values())

    def one_pass():
        got = thread_results(lambda i: gm.generate(torch.tensor([prompts[i]]), max_new_tokens=news[i],
                                                   do_sample=False), len(prompts))
        for p, n, out in zip(prompts, news, got):
            assert torch.equal(out, _alone(model, p, n))
        _idle(server)  # (every shape captured plain, then compiled)

    one_pass()
    d = gm.stats()["decode"]
    compiled = d["captures"]["compiled"]
    assert compiled and set(compiled) <= set(d["shapes"]) and d["capture_failed"] == {}
    assert all(server.compiled[s][1] is not server.twins[s] for s in compiled), "a twin of its own"
    before = replays()
    with torch.inference_mode():  # (the second pass, over the compiled graphs, as callers under it)
        one_pass()
    assert replays() > before, "the compiled graphs served the second pass"
    gm.close()


def test_with_compile_a_lone_call_never_waits_for_a_compile_and_its_capture_waits_for_the_next_call(monkeypatch):
    """Inductor's compile of a shape runs while no caller waits for it; the capture after it
    starts only while a call is in flight (a caller done with the batch may synchronize the
    device), so a lone call returns during the compile, and the capture waits for the next."""
    from graphwrap.decoding.engine import captures as captures_mod

    compiling, release = threading.Event(), threading.Event()

    def slow_compile(engine, stream, server, args, kwargs):
        compiling.set()
        release.wait(30)

    monkeypatch.setattr(captures_mod, "precompile", slow_compile)
    # The first call's plain captures wait for its end (else, on a slow host, the last of them
    # could end while it is in flight, and its compile begin then, as it may).
    ended = threading.Event()
    plain, counted = captures_mod.Captures._capture, captures_mod.Captures.calls

    def calls(self, change):
        counted(self, change)
        if self.serving == 0:
            ended.set()

    monkeypatch.setattr(captures_mod.Captures, "calls", calls)
    monkeypatch.setattr(captures_mod.Captures, "_capture", lambda self, shape: (ended.wait(30), plain(self, shape))[1])
    model = _model("gpt2")
    gm, server = _captured_beside(model, compile=True, rows=4)
    ids = torch.tensor([[4, 9, 13, 2, 7]])
    assert torch.equal(gm.generate(ids, max_new_tokens=6, do_sample=False), _alone(model, ids[0].tolist(), 6))
    caps = server.captures
    assert not compiling.is_set() and any(q[0] == "compile" for q in caps.queued()), "queued, not begun: no call"
    caps.calls(+1)  # (a call in flight: jobs begin)
    assert compiling.wait(30), "a plain capture's shape went on to compile"
    caps.calls(-1)
    t0 = time.monotonic()
    assert torch.equal(gm.generate(ids, max_new_tokens=6, do_sample=False), _alone(model, ids[0].tolist(), 6))
    assert time.monotonic() - t0 < 20 and caps.apart, "the call returned while the compile ran"
    release.set()
    time.sleep(0.2)
    with caps.cond:
        assert caps.running is not None and caps.running[0] == "compile" and caps.apart, "its capture waits"
    before = len(server.compiled)
    assert torch.equal(gm.generate(ids, max_new_tokens=6, do_sample=False), _alone(model, ids[0].tolist(), 6))
    assert caps.finish(30) and len(server.compiled) > before
    gm.close()


def test_with_compile_a_shape_whose_compile_ahead_fails_is_compiled_by_its_capture(monkeypatch, caplog):
    from graphwrap.decoding.engine import captures as captures_mod

    def failing(engine, stream, server, args, kwargs):
        raise RuntimeError("dynamo could not trace it")

    monkeypatch.setattr(captures_mod, "precompile", failing)
    model = _model("llama")
    gm, server = _captured_beside(model, compile=True, rows=4)
    ids = torch.tensor([[4, 9, 13, 2, 7]])
    with caplog.at_level("INFO", logger="graphwrap"):
        assert torch.equal(gm.generate(ids, max_new_tokens=6, do_sample=False), _alone(model, ids[0].tolist(), 6))
        assert server.captures.finish(30)
    assert server.compiled and "ahead of its capture failed (RuntimeError: dynamo could not trace it)" in caplog.text
    assert torch.equal(gm.generate(ids, max_new_tokens=6, do_sample=False), _alone(model, ids[0].tolist(), 6))
    gm.close()


class _CountingCompile:
    """A stand-in for the compiled forward's bookkeeping (graphwrap/capture/compiled.py): the
    graphs it has compiled (one, on its first call), the shapes known to run compiled code and
    the graphs compiled by a run ahead of the next capture."""

    dynamic = True

    def __init__(self):
        self.graphs, self.calls, self.shapes, self.ahead, self.fail = 0, 0, set(), None, False

    def __call__(self, *args, **kwargs):
        if self.fail:
            raise RuntimeError("dynamo could not trace it")
        self.calls += 1
        self.graphs = max(self.graphs, 1)


def test_a_compile_ahead_of_a_capture_marks_its_graph_compiled_though_the_warm_up_compiled_nothing(monkeypatch):
    """compile=: the batch runs a shape's compiled forward once before it captures it (so that no
    caller waits for Inductor); the capture's warm-up then compiles nothing, and its graph is
    still the compiled one. Before, every such graph was counted as not compiled, and the GPU
    test of compile= failed on it. A warm-up that compiled nothing with no run ahead is not."""
    from types import SimpleNamespace

    from graphwrap.capture import work
    from graphwrap.core.records import Bucket, Key
    from graphwrap.decoding.engine import captures as captures_mod

    cf = _CountingCompile()
    monkeypatch.setattr(work, "compiled_forward", lambda engine: cf)
    server = SimpleNamespace(fold=contextlib.nullcontext(), device=torch.device("cpu"))
    engine = SimpleNamespace(lock=threading.Lock(), compile_opts={})
    captures_mod.precompile(engine, None, server, (torch.zeros(2),), {})
    assert cf.calls == 1 and cf.ahead == 1, "the graph compiled ahead, for the capture to count"
    captures_mod.precompile(engine, None, server, (torch.zeros(2),), {})
    assert cf.ahead == 0, "a second run ahead compiled nothing (kernels of another shape served it)"
    cf.fail = True  # a run ahead that fails leaves no count for the capture after it
    with pytest.raises(RuntimeError):
        captures_mod.precompile(engine, None, server, (torch.zeros(2),), {})
    assert cf.ahead is None
    cf.fail = False
    for name, ran_ahead, want in (("a", True, True), ("b", False, False)):  # (one key each: a twin's)
        ks, b = Key(name, None, ((0, None, 0),), torch.device("cpu"), None, name), Bucket(4)
        work._mark_compiled(engine, ks, b, cf, 0, ran_ahead)
        assert b.compiled is want and ((name, b.point) in cf.shapes) is want


def test_capture_generate_captures_every_shape_of_the_buckets_and_later_calls_replay_them():
    model = _model("llama")
    gm, server = _captured_beside(model, rows=4, max_len=64)
    assert gm.capture_generate(timeout=120)
    d = gm.stats()["decode"]
    steps = {s for s in d["shapes"] if s[0] == "step"}
    prefills = {s for s in d["shapes"] if s[0] == "prefill"}
    assert {n for _, n, _ in steps} == set(server.sched.row_buckets) == {1, 2, 3, 4}
    assert prefills == {("prefill", k, w) for k in (1, 2, 3, 4) for w in (16, 32, 48, 64)}
    before = dict(d["eager_forwards"])
    out = gm.generate(torch.tensor([[9, 8, 7, 6]]), max_new_tokens=10, do_sample=False)
    assert torch.equal(out, _alone(model, [9, 8, 7, 6], 10))
    assert gm.stats()["decode"]["eager_forwards"] == before, "every forward served by a graph"
    gm.close()


def test_no_capture_runs_once_a_lone_call_has_returned_and_none_starts_until_the_next_call():
    """A device-wide torch.cuda.synchronize() fails while any stream captures: a caller done
    with the batch must find no capture running."""
    model = _model("gpt2")
    gm, server = _captured_beside(model, rows=4)
    caps, capture, spans = server.captures, server.captures._capture, []

    def slow(shape):
        t0 = time.monotonic()
        time.sleep(0.3)
        try:
            return capture(shape)
        finally:
            spans.append((t0, time.monotonic()))

    caps._capture = slow
    for n in (12, 3, 20):
        out = gm.generate(torch.tensor([[9, 8, 7, 6][:max(1, n % 5)]]), max_new_tokens=n, do_sample=False)
        returned = time.monotonic()
        assert caps.running is None, "the call waited for the capture under way"
        time.sleep(0.35)
        assert caps.running is None and all(end <= returned for _, end in spans), "none started after it"
        assert out.shape[1] > 0
    assert spans, "captures ran while the calls were in flight"
    assert caps.finish(60) and not caps.queued()
    gm.close()


@pytest.mark.parametrize("shapes", ["every", "first"])
def test_under_inference_mode_shapes_captured_ahead_and_beside_serve_the_models_tokens(shapes):
    """The caller in torch.inference_mode(): the twins and graphs are made outside it (the rows
    are written in place every step), and the tokens are the model's (``first``: the others
    captured beside the calls)."""
    model = _model("llama")
    with torch.inference_mode():
        gm, server = _captured_beside(model, rows=4, max_len=64)
        assert gm.capture_generate(timeout=120, shapes=shapes)
        got = thread_results(lambda i: gm.generate(torch.tensor([[9, 8, 7, 6 + i]]), max_new_tokens=8 + i,
                                                   do_sample=False), 3)
    for i, out in enumerate(got):
        assert torch.equal(out, _alone(model, [9, 8, 7, 6 + i], 8 + i))
    assert all(not t.lengths.is_inference() and not t.table.is_inference() for t in server.twins.values())
    assert gm.stats()["decode"]["capture_failed"] == {}
    gm.close()


def test_under_inference_mode_a_long_prompts_pieces_replay_and_give_the_models_tokens(monkeypatch):
    """Pieces captured ahead and beside with the caller in torch.inference_mode(), a long prompt
    beside short ones from threads: the piece twins are made outside it, the tokens are the
    model's."""
    from graphwrap.decoding.engine import pieces as pieces_mod
    from graphwrap.decoding.engine import server as server_mod

    monkeypatch.setattr(server_mod, "CHUNK", 8)
    monkeypatch.setattr(pieces_mod, "WHOLE", 0)  # (these long prompts go in pieces, found alone or not)
    model = _model("llama")
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, 101, (n,), generator=g).tolist() for n in (37, 3, 5)]
    with torch.inference_mode():
        gm, server = _captured_beside(model, rows=4, max_len=64)
        assert gm.capture_generate(timeout=120)
        got = thread_results(lambda i: gm.generate(torch.tensor([prompts[i]]), max_new_tokens=9, do_sample=False), 3)
    for p, out in zip(prompts, got):
        assert torch.equal(out, _alone(model, p, 9))
    pieces = [t for s, t in server.twins.items() if s[0] == "piece"]
    assert pieces and all(not t.at.is_inference() and not t.table.is_inference() for t in pieces)
    d = gm.stats()["decode"]
    assert d["capture_failed"] == {} and d["eager_forwards"].get("piece", 0) == 0
    gm.close()


def test_a_delivery_waiting_while_a_compile_job_starts_is_let_go_once_the_job_stands_apart(monkeypatch):
    """settle() (a call's delivery) waits while a capture runs; a compile job that begins meanwhile
    stands apart (no caller waits for it) and must wake the delivery. It set its flag without a
    notify: a delivery that began to wait between the job's start and its flag slept for good, and
    its caller with it (seen once in a CI run under load)."""
    import types

    from graphwrap.decoding.engine import captures as captures_mod

    server = types.SimpleNamespace(device=torch.device("cpu"), compiled_engines={"step": object()})
    caps = captures_mod.Captures(server)
    twin_go = threading.Event()
    monkeypatch.setattr(captures_mod.Captures, "_twin", lambda self, shape: twin_go.wait(10))
    monkeypatch.setattr(captures_mod.Captures, "_inputs", lambda self, shape, twin: ((), {}))
    monkeypatch.setattr(captures_mod, "precompile", lambda *a: None)
    shape = ("step", 4, 64)
    caps.running = (captures_mod.COMPILE, shape)
    job = threading.Thread(target=caps._compile, args=(shape,), daemon=True)
    job.start()
    settled = threading.Thread(target=caps.settle, daemon=True)
    settled.start()
    time.sleep(0.2)
    assert settled.is_alive(), "a capture runs and stands with calls: the delivery waits"
    twin_go.set()
    settled.join(10)
    assert not settled.is_alive(), "the job stood apart and the delivery still waited"
    with caps.cond:
        caps.stopped = True
        caps.cond.notify_all()
    job.join(10)
    assert not job.is_alive()


def test_waiting_for_captures_says_how_far_it_is_and_how_long_is_left(monkeypatch, gw_log):
    import types

    from graphwrap.decoding.engine import captures as cap

    assert cap.progress(0, 12, 3.0) == "capturing the shared batch's graphs: 0 of 12 shapes in 3 s"
    assert cap.progress(3, 12, 6.0).endswith("3 of 12 shapes in 6 s, about 18 s left")
    monkeypatch.setattr(cap, "PROGRESS_EVERY", 0.05)
    server = types.SimpleNamespace(device=torch.device("cpu"), compiled_engines={},
                                   shapes=types.SimpleNamespace(captured=lambda shape, why: None))
    caps = cap.Captures(server)
    monkeypatch.setattr(caps, "_capture", lambda shape: time.sleep(0.03))  # (a capture that takes its time)
    for n in range(8):
        caps.want(("step", n + 1, 64), cap.AHEAD)
    assert caps.finish(timeout=30) and caps.done == 8
    lines = [r.getMessage() for r in gw_log.records if "capturing the shared batch's graphs" in r.getMessage()]
    assert lines and all(" of 8 shapes in " in line for line in lines), lines
    assert any("s left" in line for line in lines), lines
    caps.stop(5)


def test_the_ladder_of_steps_queued_ahead_doubles_from_64_below_the_largest():
    from graphwrap.decoding.engine.captures import ladder
    from graphwrap.decoding.engine.scheduler import buckets_upto

    first = (1, 2, 4, 8, 16)
    assert ladder(buckets_upto(1024, first)) == [64, 128, 256, 512]
    assert ladder(buckets_upto(256, first)) == [64, 128]
    assert ladder(buckets_upto(96, first)) == [64]
    assert ladder(buckets_upto(64, first)) == []  # (the largest is queued ahead already)


def test_the_first_shapes_hold_every_shape_and_are_what_capture_generate_first_captures():
    """``capture_generate(shapes="first")`` (serve's start): the largest shape of each kind and
    span, the ladder of steps, prompts of one row and of the most rows at each width; every shape
    the buckets make is held by one of them, and later calls give the model's tokens."""
    from graphwrap.decoding.engine import captures

    model = _model("llama")
    gm, server = _captured_beside(model, rows=128, max_len=64)
    every, first = captures.shapes_of(server), captures.first_shapes(server)
    assert set(first) < set(every) and len(first) < len(every) / 2
    for s in every:
        assert any(f[0] == s[0] and f[1] >= s[1] and f[2] >= s[2] for f in first), f"nothing holds {s}"
    short, rows = min(s[2] for s in every if s[0] == "step"), server.prompts.row_buckets
    assert ("step", 64, short) in first and ("step", 128, short) in first and ("step", 1, short) not in first
    assert {("prefill", k, w) for k in (rows[0], rows[-1]) for w in server.prompts.width_buckets} <= set(first)
    assert gm.capture_generate(timeout=120, shapes="first")
    d = gm.stats()["decode"]
    assert set(d["shapes"]) == set(first) and d["capture_failed"] == {}
    got = thread_results(lambda i: gm.generate(torch.tensor([[9, 8, 7, 6 + i][:2 + i]]), max_new_tokens=6 + i,
                                               do_sample=False), 3)
    for i, out in enumerate(got):
        assert torch.equal(out, _alone(model, [9, 8, 7, 6 + i][:2 + i], 6 + i))
    gm.close()
    with pytest.raises(GraphwrapError, match='shapes must be "every" or "first"'):
        gm.capture_generate(shapes="most")
