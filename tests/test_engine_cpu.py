"""The engine's plans and per-call checks on the CPU, with a stand-in graph that recomputes on replay."""

import pytest
import torch
from torch import nn

from graphwrap import GraphedModule
from graphwrap.capture import Replica, tile_rows
from graphwrap.engine import describe_key
from graphwrap.plans import Bucket, Key, Plan
from graphwrap.tree import BATCHED, CONST, WHOLE, flatten_inputs, flatten_outputs, tensor_meta
from helpers import MLP
from test_verify_capture_cpu import RecomputeGraph


class TwoOut(nn.Module):
    """A batched output, a whole one and a constant."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("w", torch.randn(3))

    def forward(self, x):
        return {"y": self.lin(x), "w": self.w * 2, "tag": "t"}


def _engine_with_bucket(module, size, sample, outputs="clone"):
    """A GraphedModule's engine holding one key with one 'captured' bucket (a stand-in graph)."""
    gm = GraphedModule(module, buckets=[size], outputs=outputs)
    eng = gm.engine
    leaves, spec = flatten_inputs((sample,), {})
    meta = tensor_meta(leaves, 0)
    ks = Key(describe_key(spec, meta, None), spec, torch.device("cpu"), None, "seen", (sample.dtype, -1))
    static_in = [tile_rows(sample, sample.shape[0], size, 0)]
    with torch.no_grad():
        out, out_spec = flatten_outputs(module(*static_in))
    static_out = [o.clone() if isinstance(o, torch.Tensor) else o for o in out]
    kinds = [BATCHED if isinstance(o, torch.Tensor) and o.shape[0] == size else
             (WHOLE if isinstance(o, torch.Tensor) else CONST) for o in out]
    ks.kinds, ks.out_spec = kinds, out_spec
    b = ks.buckets[size] = Bucket(size)
    b.replicas.append(Replica(RecomputeGraph(module, static_in, static_out), size, 0, static_in, static_out, kinds))
    return gm, eng, ks, b


@pytest.mark.parametrize("n", [1, 3, 8])
def test_plan_views_run_and_clone(n):
    model = MLP().eval()
    gm, eng, ks, b = _engine_with_bucket(model, 8, torch.randn(8, 32))
    plan = Plan(eng, ks, n, b)
    assert not plan.eager and plan.size == 8 and plan.single_out
    assert plan.input.shape == (n, 32) and plan.input.data_ptr() == b.replicas[0].static_inputs[0].data_ptr()
    assert plan.output.shape == (n, 16)
    for _ in range(3):  # fresh inputs every call: a stale static buffer would show
        x = torch.randn(n, 32)
        with torch.no_grad():
            (got,) = plan.run([x])
            want = model(x)
        torch.testing.assert_close(got, want)
        assert got.data_ptr() != plan.output.data_ptr(), "clone: an output the caller owns"
    (view,) = plan.run([torch.randn(n, 32)], clone=False)
    assert view.data_ptr() == plan.output.data_ptr(), "clone=False: the static output itself"
    assert plan.calls == 4


def test_plan_of_several_outputs_keeps_whole_and_constant_outputs():
    model = TwoOut().eval()
    gm, eng, ks, b = _engine_with_bucket(model, 4, torch.randn(4, 8))
    plan = Plan(eng, ks, 3, b)
    assert not plan.single_out
    x = torch.randn(3, 8)
    with torch.no_grad():
        got = plan.rebuild(plan.run([x]))
        want = model(x)
    torch.testing.assert_close(got["y"], want["y"])
    torch.testing.assert_close(got["w"], want["w"])
    assert got["tag"] == "t" and list(got) == ["y", "w", "tag"]


def test_stats_count_rows_and_padding_from_plans():
    gm, eng, ks, b = _engine_with_bucket(MLP().eval(), 8, torch.randn(8, 32))
    eng.store.keys["k"] = ks
    for n, calls in ((3, 2), (8, 1)):
        plan = ks.plans[n] = Plan(eng, ks, n, b)
        for _ in range(calls):
            plan.run([torch.randn(n, 32)])
    b.count(5)  # a pipeline's replay of a leased graph
    s = gm.stats()
    st = s["keys"][0]["buckets"][8]
    assert st["replays"] == 4 and st["rows"] == 3 * 2 + 8 + 5 and st["padded_rows"] == 5 * 2 + 3
    assert s["padded_share"] == pytest.approx(13 / (19 + 13))


def test_eager_plans_by_choice_and_by_reason():
    model = MLP().eval()
    gm, eng, ks, b = _engine_with_bucket(model, 8, torch.randn(8, 32))
    eng.store.keys["k"] = ks
    b.serves = "eager"
    chosen = ks.plans[2] = Plan(eng, ks, 2, b)
    assert chosen.eager and chosen.reason is None
    x = torch.randn(2, 32)
    with torch.no_grad():
        torch.testing.assert_close(eng.eager_plan(chosen, (x,), {}), model(x))
    failed = Plan(eng, ks, 3, Bucket(4), reason="out of memory in capture at batch 4")
    with torch.no_grad():
        eng.eager_plan(failed, (torch.randn(3, 32),), {})
    s = gm.stats()
    assert s["eager_by_choice"] == 1 and s["keys"][0]["buckets"][8]["serves"] == "eager"
    assert s["eager_calls"] == {"out of memory in capture at batch 4": 1}


def test_fast_path_checks_fall_back_to_the_general_path():
    model = MLP().eval()
    gm, eng, ks, b = _engine_with_bucket(model, 8, torch.randn(8, 32))
    eng._record_ptrs()
    x = torch.randn(3, 32)
    plan = eng.fast[x.shape] = Plan(eng, ks, 3, b)
    assert eng.fast_plan(x) is plan
    assert eng.fast_plan(torch.randn(3, 32, dtype=torch.float64)) is None, "another dtype"
    assert eng.fast_plan(torch.randn(4, 32)) is None, "a shape without a plan"
    with torch.enable_grad():
        assert eng.fast_plan(torch.randn(3, 32, requires_grad=True)) is None, "grad needed"
    with torch.no_grad():
        assert eng.fast_plan(torch.randn(3, 32, requires_grad=True)) is plan
    model.train()
    assert eng.fast_plan(x) is None, "training mode"
    model.eval()
    with torch.autocast("cuda", enabled=True) if torch.cuda.is_available() else _cuda_autocast_flag():
        assert eng.fast_plan(x) is None, "autocast"
    assert eng.fast_plan(x) is plan
    model.layers[0].weight.data = torch.randn(64, 32)
    assert eng.fast_plan(x) is None, "a weight moved"


class _cuda_autocast_flag:
    """CUDA autocast switched on by its flag alone, as torch.autocast("cuda") would (no CUDA here)."""

    def __enter__(self):
        torch._C.set_autocast_enabled(True) if not hasattr(torch, "get_autocast_dtype") else \
            torch._C.set_autocast_enabled("cuda", True)

    def __exit__(self, *exc):
        torch._C.set_autocast_enabled(False) if not hasattr(torch, "get_autocast_dtype") else \
            torch._C.set_autocast_enabled("cuda", False)


def test_a_new_parameter_counts_as_moved_weights():
    model = MLP().eval()
    gm, eng, ks, b = _engine_with_bucket(model, 8, torch.randn(8, 32))
    eng._record_ptrs()
    eng.fast[torch.Size([3, 32])] = Plan(eng, ks, 3, b)
    model.extra = nn.Parameter(torch.randn(2))
    assert eng.fast_plan(torch.randn(3, 32)) is None
    eng.prepare((torch.randn(3, 32),), {})
    assert eng.ptrs is None and not eng.fast, "graphs dropped"
