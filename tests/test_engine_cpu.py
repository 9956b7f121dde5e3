"""The engine on the CPU, with a stand-in graph that recomputes on replay: plans, owned and view
outputs, stats, eager plans, the per-call checks, captures that never block other callers,
sequence buckets, the memory budget and what a failed capture leaves."""

import os
import threading

import pytest
import torch
from helpers import MLP, RowMixer, Scales, assert_same, eager_answer, on_cpu_graphs
from serve_models import NoNaN
from torch import nn

from graphwrap import GraphedModule, GraphwrapError
from graphwrap.core.records import Serves


def _gm(model, **kw):
    kw.setdefault("eager_if_faster", False)
    return on_cpu_graphs(GraphedModule(model, **kw))


class TwoOut(nn.Module):
    """A batched output, a whole one and a constant."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("w", torch.randn(3))

    def forward(self, x):
        return {"y": self.lin(x), "w": self.w * 2, "tag": "t"}


@pytest.mark.parametrize("n", [1, 3, 8])
def test_calls_replay_the_bucket_graph_with_owned_or_view_outputs(n):
    model = MLP().eval()
    gm = _gm(model, buckets=[8])
    for _ in range(3):  # fresh inputs every call: a stale static buffer would show
        x = torch.randn(n, 32)
        got = gm(x)
        assert_same(got, eager_answer(model, x))
    (ks,) = gm.engine.store.keys.values()
    g = ks.buckets[(8, None)].graphs[0]
    assert got.data_ptr() != g.static_outputs[0].data_ptr(), "owned: not the static output"
    gv = _gm(model, buckets=[8], outputs="view")
    v = gv(torch.randn(n, 32))
    (ks,) = gv.engine.store.keys.values()
    assert v.data_ptr() == ks.buckets[(8, None)].graphs[0].static_outputs[0].data_ptr()
    assert gm.stats()["keys"][0]["buckets"][8]["replays"] == 3


def test_several_outputs_keep_whole_and_constant_ones():
    model = TwoOut().eval()
    gm = _gm(model, buckets=[4])
    x = torch.randn(3, 8)
    got = gm(x)
    assert list(got) == ["y", "w", "tag"] and got["tag"] == "t"
    assert_same(got, eager_answer(model, x))


def test_stats_count_rows_and_padding():
    gm = _gm(MLP().eval(), buckets=[8])
    for n, calls in ((3, 2), (8, 1)):
        for _ in range(calls):
            gm(torch.randn(n, 32))
    (ks,) = gm.engine.store.keys.values()
    ks.buckets[(8, None)].replayed(5)  # a pipeline's replay of a leased graph
    s = gm.stats()
    st = s["keys"][0]["buckets"][8]
    assert st["replays"] == 4 and st["rows"] == 3 * 2 + 8 + 5 and st["padded_rows"] == 5 * 2 + 3
    assert s["padded_share"] == pytest.approx(13 / (19 + 13))


def test_eager_by_choice_and_by_reason():
    model = MLP().eval()
    gm = _gm(model, buckets=[4, 8])
    gm(torch.randn(2, 32))
    (ks,) = gm.engine.store.keys.values()
    with gm.engine.lock:
        ks.buckets[(4, None)].serves = Serves.EAGER
        ks.plans.clear()
        gm.engine.fast.clear()
    x = torch.randn(3, 32)
    assert_same(gm(x), eager_answer(model, x))
    s = gm.stats()
    assert s["eager_by_choice"] == 1 and s["keys"][0]["buckets"][4]["serves"] == "eager"
    assert s["eager_calls"] == {}
    assert not gm(x).requires_grad, "eager by choice: outputs without grad, as a graph's"


def test_fast_path_checks_fall_back_to_the_general_path():
    model = MLP().eval()
    gm = _gm(model, buckets=[4])
    eng = gm.engine
    x = torch.randn(3, 32)
    gm(x)
    plan = eng.fast_plan(x)
    assert plan is not None and not plan.eager
    assert eng.fast_plan(torch.randn(3, 32, dtype=torch.float64)) is None, "another dtype"
    assert eng.fast_plan(torch.randn(4, 32)) is None, "a shape without a plan"
    with torch.enable_grad():
        assert eng.fast_plan(torch.randn(3, 32, requires_grad=True)) is None, "grad needed"
    with torch.no_grad():
        assert eng.fast_plan(torch.randn(3, 32, requires_grad=True)) is plan
    model.train()
    assert eng.fast_plan(x) is None, "training mode"
    model.eval()
    assert eng.fast_plan(x) is None, "train() and eval() move the counter: the next call reads the tree"
    assert_same(gm(x), eager_answer(model, x))
    assert eng.fast_plan(x) is plan, "the flags are as captured: the same plan"
    model.layers[0].weight.data = torch.randn(64, 32)
    assert eng.fast_plan(x) is None, "a weight moved"
    assert_same(gm(x), eager_answer(model, x))
    assert eng.watch.ptrs is not None and len(gm.stats()["keys"]) == 1, "captured again"


def test_a_new_parameter_counts_as_moved_weights():
    model = MLP().eval()
    gm = _gm(model, buckets=[4])
    x = torch.randn(3, 32)
    gm(x)
    epoch = gm.engine.epoch
    model.extra = nn.Parameter(torch.randn(2))
    assert gm.engine.fast_plan(x) is None
    assert_same(gm(x), eager_answer(model, x))
    assert gm.engine.epoch > epoch, "graphs dropped and captured again"


class _Blocks(nn.Module):
    """Blocks on its first padded warm-up (a capture in progress) until released."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.capturing, self.release = threading.Event(), threading.Event()
        self.block = True

    def forward(self, x):
        if self.block and x.shape[0] == 8:
            self.block = False
            self.capturing.set()
            assert self.release.wait(10)
        return self.lin(x)


def test_other_callers_are_served_eagerly_while_a_bucket_is_captured():
    model = _Blocks().eval()
    gm = _gm(model, buckets=[8])
    first = threading.Thread(target=lambda: gm(torch.randn(3, 8)))
    first.start()
    assert model.capturing.wait(10)
    for n in (1, 5, 8):  # the same bucket, during its capture: answered at once, eagerly
        x = torch.randn(n, 8)
        assert_same(gm(x), eager_answer(model, x))
    assert gm.stats()["keys"][0]["eager_while_warming"] == 3
    model.release.set()
    first.join(10)
    x = torch.randn(6, 8)
    assert_same(gm(x), eager_answer(model, x))
    assert gm.stats()["keys"][0]["buckets"][8]["replays"] == 2


def test_a_row_mixer_runs_eagerly_and_fallback_raise_raises():
    model = RowMixer().eval()
    gm = _gm(model, buckets=[4])
    x = torch.randn(3, 8)
    assert_same(gm(x), eager_answer(model, x))
    k = gm.stats()["keys"][0]
    assert k["status"] == "eager" and "mixes rows" in k["reason"]
    strict = _gm(model, buckets=[4], fallback="raise")
    with pytest.raises(GraphwrapError, match="mixes rows"):
        strict(x)


def test_a_forward_that_writes_into_its_input_gets_eagers_answer_and_the_callers_tensor_as_eager_leaves_it():
    model = Scales().eval()
    gm = _gm(model, buckets=[4])
    for n in (3, 4, 2):
        x = torch.randn(n, 4) * 255
        x_eager = x.clone()
        want = eager_answer(model, x_eager)
        got = gm(x)
        assert_same(got, want)
        assert_same(x, x_eager), "the caller's tensor divided once, as eager divides it"
    k = gm.stats()["keys"][0]
    assert k["status"] == "eager" and "writes into its input x" in k["reason"]


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids)
        m = attention_mask.unsqueeze(-1).float()
        ctx = (h * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        return {"last": self.lin(h + ctx), "pooled": ctx.squeeze(1)}


def _text(n, L, pad_from=None):
    ids = torch.randint(1, 50, (n, L))
    mask = torch.ones(n, L, dtype=torch.long)
    if pad_from is not None:
        mask[:, pad_from:] = 0
    return ids, mask


def test_sequence_buckets_every_length_and_the_padded_tokens():
    model = Masked().eval()
    gm = _gm(model, seq_dim=1, max_batch_size=8)
    for L in list(range(1, 70)) + [200, 3, 512]:
        n = 1 + L % 5
        ids, mask = _text(n, L, pad_from=max(1, L - 2) if L % 3 == 0 else None)
        assert_same(gm(input_ids=ids, attention_mask=mask), eager_answer(model, input_ids=ids, attention_mask=mask))
    s = gm.stats()
    assert s["eager_calls"] == {} and len(s["keys"]) == 1
    assert set(s["seq_buckets"]) >= {16, 32, 48, 64, 96, 256, 512}
    b = s["keys"][0]["buckets"]
    assert "2x16" in b and all(v["seq"] in s["seq_buckets"] for v in b.values())
    assert 0 < s["padded_token_share"] < 1 and s["tokens"] == sum((1 + L % 5) * L for L in
                                                                 list(range(1, 70)) + [200, 3, 512])
    ids, mask = _text(1, 600)
    assert_same(gm(input_ids=ids, attention_mask=mask), eager_answer(model, input_ids=ids, attention_mask=mask))
    assert any("longer than the longest sequence bucket" in r for r in gm.stats()["eager_calls"])


def test_batches_above_the_token_budget_are_served_in_chunks():
    model = Masked().eval()
    gm = _gm(model, seq_dim=1, max_tokens=64, max_batch_size=8)
    ids, mask = _text(7, 30)  # bucket 32: at most 2 rows a graph
    assert_same(gm(input_ids=ids, attention_mask=mask), eager_answer(model, input_ids=ids, attention_mask=mask))
    b = gm.stats()["keys"][0]["buckets"]
    assert set(b) == {"2x32", "1x32"} and b["2x32"]["replays"] == 3 and b["1x32"]["replays"] == 1


def test_the_memory_budget_drops_the_least_used_graphs_and_captures_them_again():
    model = MLP(d_out=64).eval()  # outputs of 256 bytes a row: the stand-in's pool estimate
    gm = _gm(model, buckets=[1, 2, 4, 8], max_pool_bytes=256 * 8 + 256 * 4)
    sizes = [8] * 5 + [4] * 3 + [2, 1, 2, 4, 8, 1]
    for n in sizes:
        x = torch.randn(n, 32)
        assert_same(gm(x), eager_answer(model, x))
    s = gm.stats()
    assert s["eager_calls"] == {}
    b = s["keys"][0]["buckets"]
    live = sum(v["pool_bytes"] for v in b.values() if v["captured"])
    assert 0 < live <= 256 * 12
    assert any(not v["captured"] and v["replays"] for v in b.values()), "a bucket was dropped after serving"
    assert sum(v["replays"] + v["eager_calls"] for v in b.values()) == len(sizes)


def test_a_detached_store_holds_no_device():
    """After reset() (the module moved to another GPU, say), the next key sets the device anew."""
    from graphwrap.core.records import Store

    store = Store(lambda d: None)
    store.device, store.pool = torch.device("cuda", 0), object()
    keys, pool, device, dropped = store.detach()
    assert device == torch.device("cuda", 0) and pool is not None and dropped == []
    assert store.device is None and store.pool is None and store.keys == {} and store.epoch == 1


def test_a_module_error_in_the_first_call_of_a_bucket_leaves_it_to_the_next_call():
    """The call that would capture raises the module's own error: the next calls of that bucket
    capture and replay (the bucket is not left marked as capturing, served eagerly for good)."""
    gm = on_cpu_graphs(GraphedModule(NoNaN().eval(), eager_if_faster=False))
    x = torch.randn(4, 4)
    x[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        gm(x)
    for _ in range(3):
        gm(torch.randn(4, 4))
    b = gm.stats()["keys"][0]["buckets"][4]
    assert b["serves"] == "graph" and b["replays"] == 3 and gm.stats()["keys"][0]["eager_while_warming"] == 0


def _graphwrap_files_of(gm, x):
    """The graphwrap files whose Python code ``gm(x)`` runs, in order of first entry; the CPU
    stand-in's replays (code of the tests' own, which run the forward again) are left out, as
    a GPU replays in C++."""
    import os
    import sys

    import graphwrap

    # By the package's and the tests' own folders (a checkout may sit in a folder named
    # "graphwrap" or under one named "tests").
    package = os.path.dirname(os.path.abspath(graphwrap.__file__)) + os.sep
    tests = os.path.dirname(os.path.abspath(__file__)) + os.sep
    start, seen = sys._getframe(), []

    def in_stand_in(frame):
        f = frame.f_back
        while f is not None and f is not start:
            if os.path.abspath(f.f_code.co_filename).startswith(tests):
                return True
            f = f.f_back
        return False

    def profile(frame, event, arg):
        name = os.path.abspath(frame.f_code.co_filename)
        if event == "call" and name.startswith(package) and not in_stand_in(frame):
            name = name[len(package):]
            if name not in seen:
                seen.append(name)

    sys.setprofile(profile)
    try:
        gm(x)
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("outputs", ["clone", "view"])
def test_a_warm_call_runs_code_of_at_most_five_files(outputs):
    # The common call, gm(x) of a shape seen before, stays a short path: the face, the engine's
    # per-call checks, the plan and the output slots.
    gm = _gm(nn.Linear(8, 8).eval(), outputs=outputs)
    x = torch.randn(4, 8)
    for _ in range(4):
        gm(x)
    files = _graphwrap_files_of(gm, x)
    assert files[:3] == ["module.py", os.path.join("core", "engine.py"), os.path.join("core", "watch.py")], files
    assert os.path.join("core", "plans.py") in files and len(files) <= 5, files


class _DictIn(nn.Module):
    def forward(self, d):
        return d["S"] + d["x"]


def test_a_dict_input_whose_first_key_is_S_is_graphed():
    # Its keys ("S", "x") were once read as a state input: the call raised AttributeError.
    gm = _gm(_DictIn().eval())
    for n in (3, 5):
        d = {"S": torch.randn(n, 2), "x": torch.randn(n, 2)}
        assert_same(gm(d), d["S"] + d["x"])
    assert gm.stats()["keys"][0]["status"] == "graphed"


def test_deleting_the_module_lets_go_of_its_graphs_without_a_garbage_collection():
    # The engine is in reference cycles (its parts point back at it), so it waits for the
    # garbage collector; the graphs, their buffers and the plans that point at them must not.
    import gc
    import weakref

    gm = _gm(MLP().eval(), buckets=[4, 8])
    for n in (3, 3, 6):
        gm(torch.randn(n, 32))
    plan = gm.engine.fast_plan(torch.randn(3, 32))
    assert plan is not None and plan.graph is not None, "the one-tensor path holds a plan"
    static = weakref.ref(plan.graph.static_inputs[0])  # a graph's buffer
    del plan
    gc.disable()
    try:
        del gm
        assert static() is None, "a graph's buffer outlived its GraphedModule until the next garbage collection"
        gm = _gm(MLP().eval(), buckets=[4])
        gm(torch.randn(3, 32))
        static = weakref.ref(gm.engine.fast_plan(torch.randn(3, 32)).graph.static_inputs[0])
        gm.reset()
        assert static() is None, "a graph's buffer outlived reset() until the next garbage collection"
    finally:
        gc.enable()
