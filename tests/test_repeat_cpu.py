"""A call repeated with a few tensors replaced (graphwrap.loops.repeat, the decode loop's way to
the engine), on the CPU stand-in for graphs: the kept plan replays only while nothing it was
made for has changed; each change sends the call the direct way, and every answer is eager's."""

import torch
from helpers import on_cpu_graphs
from torch import nn

from graphwrap import GraphedModule
from graphwrap.core.plans import fold
from graphwrap.loops.repeat import Repeat


class Box:
    """A cache object holding a tensor the step writes in place."""

    def __init__(self, k):
        self.k = k


class Step(nn.Module):
    """A decode step: writes its keys at ``pos`` of the cache, attends over what is written."""

    def __init__(self, d=8):
        super().__init__()
        self.q, self.kv = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, cache, pos, scale=1.0):
        cache.k.index_copy_(1, pos, self.kv(x))
        scores = self.q(x) @ cache.k.transpose(1, 2)
        mask = torch.arange(cache.k.shape[1]) <= pos[-1]
        out = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ cache.k
        return {"logits": out * scale, "hidden": x * 2}


def _setup():
    torch.manual_seed(0)
    model = Step().eval()
    gm = on_cpu_graphs(GraphedModule(model, state=["cache"], batch_dim={"pos": None}, eager_if_faster=False))
    mine, ref = Box(torch.zeros(2, 32, 8)), Box(torch.zeros(2, 32, 8))
    return model, gm, mine, ref


def _step(repeat, model, kw, ref, p, x=None):
    """One step at position ``p``: the repeated call against the model on its own cache."""
    x = torch.randn(2, 1, 8) if x is None else x
    kw["x"], kw["pos"] = x, torch.tensor([p])
    before = repeat.calls
    got = repeat(kw).clone()
    want = model(**dict(kw, cache=ref))["logits"]
    assert torch.allclose(got, want, atol=1e-6), p
    return repeat.calls - before  # 1: the kept plan replayed; 0: the direct way


def test_a_repeated_call_replays_its_kept_plan_with_eagers_answers():
    model, gm, mine, ref = _setup()
    repeat = Repeat(gm.engine, ("x", "pos"), "logits")
    kw = {"x": None, "cache": mine, "pos": None}
    with torch.no_grad():
        kept = [_step(repeat, model, kw, ref, p) for p in range(8)]
    assert kept == [0] + [1] * 7, "the first call goes the direct way and is kept"
    assert torch.equal(mine.k, ref.k), "the cache written in place, as eagerly"
    assert gm.stats()["eager_calls"] == {}


def test_each_change_sends_the_call_the_direct_way_and_keeps_eagers_answers():
    model, gm, mine, ref = _setup()
    repeat = Repeat(gm.engine, ("x", "pos"), "logits")
    kw = {"x": None, "cache": mine, "pos": None}
    p = iter(range(32))
    with torch.no_grad():
        assert [_step(repeat, model, kw, ref, next(p)) for _ in range(3)] == [0, 1, 1]

        kw["scale"] = 0.5  # another input: another dict content
        assert _step(repeat, model, kw, ref, next(p)) == 0
        assert _step(repeat, model, kw, ref, next(p)) == 1

        kw["scale"] = 0.25  # a kept input replaced by another object
        assert _step(repeat, model, kw, ref, next(p)) == 0

        kw = dict(kw)  # the same inputs in another dict
        assert _step(repeat, model, kw, ref, next(p)) == 0

        mine.k, ref.k = mine.k.clone(), ref.k.clone()  # the state's tensor allocated again
        assert _step(repeat, model, kw, ref, next(p)) == 0
        assert _step(repeat, model, kw, ref, next(p)) == 1

        model.q = nn.Linear(8, 8).eval()  # the module changed: the watch sees it
        assert _step(repeat, model, kw, ref, next(p)) == 0

        gm.engine.reset()  # every graph dropped
        assert _step(repeat, model, kw, ref, next(p)) == 0

        ks = repeat.kept.plan.key  # the kept plan's bucket dropped (the memory budget does this)
        with gm.engine.lock:
            fold(gm.engine, ks, None)
        assert _step(repeat, model, kw, ref, next(p)) == 0
        assert _step(repeat, model, kw, ref, next(p)) == 1

    model.train()  # training mode: eager, never kept
    with torch.no_grad():
        assert _step(repeat, model, kw, ref, next(p)) == 0
    model.eval()
    with torch.enable_grad():  # a replaced tensor that needs grad, where grad is on
        x = torch.randn(2, 1, 8, requires_grad=True)
        kw["x"], kw["pos"] = x, torch.tensor([next(p)])
        before = repeat.calls
        got = repeat(kw)
        want = model(**dict(kw, cache=ref))["logits"]
        assert repeat.calls == before and got.requires_grad and torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(mine.k, ref.k, atol=1e-6)


def test_a_replaced_tensor_of_another_shape_goes_the_direct_way():
    model, gm, mine, ref = _setup()
    repeat = Repeat(gm.engine, ("x", "pos"), "logits")
    kw = {"x": None, "cache": mine, "pos": None}
    with torch.no_grad():
        assert [_step(repeat, model, kw, ref, p) for p in range(3)] == [0, 1, 1]
        kw["x"], kw["pos"] = torch.randn(2, 2, 8), torch.tensor([3, 4])  # two new positions where one was
        before = repeat.calls
        got = repeat(kw).clone()
        want = model(**dict(kw, cache=ref))["logits"]
        assert torch.allclose(got, want, atol=1e-6) and repeat.calls == before
        assert _step(repeat, model, kw, ref, 5, x=torch.randn(2, 1, 8)) == 0, "back to one: the first key's plan"
        assert _step(repeat, model, kw, ref, 6) == 1
