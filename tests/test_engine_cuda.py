"""The engine on a GPU: every batch size with default settings, owned outputs, eager when faster,
large batches from pinned memory."""

import pytest
import torch
from torch import nn

import graphwrap.engine
from graphwrap import GraphedModule
from helpers import MLP, assert_same

pytestmark = pytest.mark.cuda
DEV = "cuda"


def _eager(model, *args):
    with torch.no_grad():
        return model(*args)


@pytest.mark.parametrize("where", ["cuda", "pinned", "pageable"])
def test_defaults_every_size_and_past_the_largest(where):
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model)
    sizes = list(range(1, 301)) + [512, 1280, 257, 1]
    for n in sizes:
        x = torch.randn(n, 32)
        if where == "cuda":
            x = x.to(DEV)
        elif where == "pinned":
            x = x.pin_memory()
        got = gm(x)
        assert got.device.type == "cuda" and got.shape == (n, 16)
        assert_same(got, _eager(model, x.to(DEV)))
    s = gm.stats()
    assert s["eager_calls"] == {}
    served = sum(b["replays"] + b["eager_calls"] for b in s["keys"][0]["buckets"].values())
    assert served >= len(sizes)


def test_a_pinned_buffer_refilled_after_each_large_call():
    # The chunked path copies host inputs asynchronously; the call returns only once they are
    # read, so the caller may refill the buffer at once.
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, max_batch_size=64)
    buf = torch.empty(600, 32).pin_memory()
    outs, wants = [], []
    for _ in range(20):
        buf.copy_(torch.randn(600, 32))
        wants.append(_eager(model, buf.to(DEV)))
        outs.append(gm(buf))
    for got, want in zip(outs, wants):
        assert_same(got, want)


def test_owned_outputs_stay_intact_across_many_later_calls():
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, buckets=[1, 4, 16])
    kept = []
    for i in range(60):
        n = 1 + (i * 7) % 40  # some above the largest bucket
        x = torch.randn(n, 32, device=DEV)
        kept.append((gm(x), _eager(model, x)))
    for _ in range(500):
        gm(torch.randn(1 + int(torch.randint(0, 40, ())), 32, device=DEV))
    for got, want in kept:
        assert_same(got, want)


def test_a_bucket_that_eager_beats_is_served_eagerly(monkeypatch):
    monkeypatch.setattr(graphwrap.engine, "race", lambda rep, eager_call, clone: (10e-6, 5e-6))
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, buckets=[4, 8])
    for n in (1, 3, 4, 6, 20):
        x = torch.randn(n, 32, device=DEV)
        assert_same(gm(x), _eager(model, x))
    xs = [torch.randn(n, 32).pin_memory() for n in (2, 7, 3)]
    for x, got in zip(xs, gm.pipeline(xs)):
        assert_same(got, _eager(model, x.to(DEV)))
    s = gm.stats()
    for b in s["keys"][0]["buckets"].values():
        assert b["serves"] == "eager" and b["graph_us"] == pytest.approx(10) and b["eager_us"] == pytest.approx(5)
        assert b["replays"] == 0
    assert s["eager_calls"] == {} and s["eager_by_choice"] >= 5


def test_the_race_is_timed_and_either_answer_is_right():
    model = nn.Linear(64, 64).to(DEV).eval()
    gm = GraphedModule(model)
    for n in (1, 1, 5, 5):
        x = torch.randn(n, 64, device=DEV)
        assert_same(gm(x), _eager(model, x))
    buckets = gm.stats()["keys"][0]["buckets"]
    for size in (1, 8):
        b = buckets[size]
        assert b["graph_us"] > 0 and b["eager_us"] > 0 and b["serves"] in ("graph", "eager")
        print(f"\nLinear(64, 64), bucket {size}: graph {b['graph_us']:.1f} us, eager {b['eager_us']:.1f} us, "
              f"serves {b['serves']}")
    off = GraphedModule(model, eager_if_faster=False)
    off(torch.randn(1, 64, device=DEV))
    b = off.stats()["keys"][0]["buckets"][1]
    assert b["serves"] == "graph" and b["graph_us"] is None


@pytest.mark.parametrize("to_host", [False, True])
def test_pipeline_of_large_batches_from_pinned_memory(to_host):
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, max_batch_size=64)
    xs = [torch.randn(n, 32).pin_memory() for n in (300, 5, 512, 64, 1280, 65, 1)]
    outs = list(gm.pipeline(xs, to_host=to_host))
    for x, got in zip(xs, outs):
        want = _eager(model, x.to(DEV))
        assert_same(got.to(DEV) if to_host else got, want)
        assert got.is_pinned() if to_host else got.is_cuda
