"""The Batcher on the CPU (eager calls): joining, splitting, ordering, back-pressure, failures, close."""

import asyncio
import threading

import pytest
import torch
from helpers import MLP, MultiIO, Out, RowMixer, assert_same, eager_answer, run_threads
from torch import nn

from graphwrap import Batcher, GraphedModule, GraphwrapError
from graphwrap.core.reasons import Eager
from graphwrap.core.tree import BATCHED, CONST, WHOLE, flatten_outputs
from graphwrap.loops.joins import join_verdict, split_outputs

TOL = 1e-5


def _gather(batcher, calls):
    """Every call in ``calls`` (``(args, kwargs)``) awaited at once from one event loop."""
    async def main():
        return await asyncio.gather(*(batcher.acall(*a, **k) for a, k in calls), return_exceptions=True)
    return asyncio.run(main())


def test_asyncio_requests_are_joined_after_a_probe_and_each_gets_its_own_rows():
    model = MLP().eval()
    b = Batcher(GraphedModule(model))
    for round_ in range(3):
        xs = [torch.randn(n, 32) for n in (1, 3, 2, 1, 5)]
        outs = _gather(b, [((x,), {}) for x in xs])
        for x, got in zip(xs, outs):
            assert_same(got, eager_answer(model, x), TOL)
    s = b.stats()
    assert s["probes"] == 1 and s["joined_calls"] == 2 and s["rows_per_joined_call"] == 12
    assert s["requests"] == 15 and s["queue_wait_ms"]["p50"] is not None


def test_every_input_and_output_structure_joins_and_splits():
    model = MultiIO().eval()
    b = Batcher(GraphedModule(model))

    def inputs(n):
        return ((torch.randn(n, 8), (torch.randn(n, 8), {"m": torch.randn(n, 8)})),
                {"scale": 0.5, "mode": "sum", "extra": torch.randn(n, 3)})

    for _ in range(2):
        calls = [inputs(n) for n in (2, 1, 4)]
        outs = _gather(b, calls)
        for (a, k), got in zip(calls, outs):
            want = eager_answer(model, *a, **k)
            assert_same(got, want, TOL)
            assert isinstance(got[0], Out) and got[2] == 7
    assert b.stats()["joined_calls"] == 1
    # the unbatched output is each request's own tensor
    w = [o[1]["w"] for o in outs]
    assert w[0].data_ptr() != w[1].data_ptr()


def test_signatures_queue_apart():
    class Act(nn.Module):
        def forward(self, x, scale=1.0):
            return torch.tanh(x) * scale

    model = Act().eval()
    b = Batcher(GraphedModule(model))
    for _ in range(2):
        calls = [((torch.randn(2, 8),), {}), ((torch.randn(1, 8).double(),), {}), ((torch.randn(3, 8),), {}),
                 ((torch.randn(2, 5),), {}), ((torch.randn(1, 8),), {"scale": 2.0}), ((torch.randn(2, 8),), {})]
        outs = _gather(b, calls)
        for (a, k), got in zip(calls, outs):
            assert_same(got, model(*a, **k), TOL)
    assert b.stats()["joined_calls"] == 1, "the three float32 requests without scale, once probed"


def test_a_model_that_mixes_rows_is_never_joined():
    model = RowMixer().eval()
    b = Batcher(GraphedModule(model))
    for _ in range(3):
        xs = [torch.randn(n, 8) for n in (2, 3, 1)]
        for x, got in zip(xs, _gather(b, [((x,), {}) for x in xs])):
            assert_same(got, eager_answer(model, x), TOL)
    s = b.stats()
    assert s["joined_calls"] == 0 and s["probes"] <= 1 and s["alone_calls"] == 9


def test_a_failing_request_fails_alone():
    class NoNaN(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if bool(torch.isnan(x).any()):
                raise ValueError("NaN in the input")
            return self.lin(x)

    model = NoNaN().eval()
    b = Batcher(GraphedModule(model))
    _gather(b, [((torch.randn(2, 4),), {}), ((torch.randn(1, 4),), {})])  # the probe: joined from now on
    xs = [torch.randn(2, 4), torch.full((1, 4), float("nan")), torch.randn(3, 4)]
    outs = _gather(b, [((x,), {}) for x in xs])
    assert isinstance(outs[1], ValueError)
    assert_same(outs[0], eager_answer(model, xs[0]), TOL)
    assert_same(outs[2], eager_answer(model, xs[2]), TOL)


class _Gate(nn.Module):
    """Blocks in forward until released, so that requests pile up behind a busy batcher."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, x):
        self.entered.set()
        assert self.release.wait(10)
        return self.lin(x)


def _busy(b, gate):
    """A thread whose request holds the batcher busy in the module; returns it, started."""
    t = threading.Thread(target=lambda: b(torch.randn(1, 4)))
    t.start()
    assert gate.entered.wait(10)
    return t


def test_back_pressure_blocks_or_raises():
    gate = _Gate().eval()
    b = Batcher(GraphedModule(gate), max_queue=2)
    t = _busy(b, gate)
    futs = [b.submit(torch.randn(1, 4)) for _ in range(2)]
    with pytest.raises(GraphwrapError, match="queue is full"):
        b.submit(torch.randn(1, 4), block=False)
    with pytest.raises(GraphwrapError, match="stayed full"):
        b.submit(torch.randn(1, 4), timeout=0.05)
    gate.release.set()
    t.join(10)
    for f in futs:
        assert f.result(10).shape == (1, 4)


def test_close_serves_what_is_queued_and_refuses_what_comes_after():
    gate = _Gate().eval()
    b = Batcher(GraphedModule(gate))
    t = _busy(b, gate)
    futs = [b.submit(torch.randn(n, 4)) for n in (1, 2, 3)]
    closer = threading.Thread(target=b.close)
    closer.start()
    gate.release.set()
    closer.join(10)
    t.join(10)
    assert [f.result(0).shape[0] for f in futs] == [1, 2, 3]
    with pytest.raises(GraphwrapError, match="closed"):
        b.submit(torch.randn(1, 4))
    with pytest.raises(GraphwrapError, match="closed"):
        b(torch.randn(1, 4))


def test_close_fails_what_it_cannot_serve_in_time():
    gate = _Gate().eval()
    b = Batcher(GraphedModule(gate))
    t = _busy(b, gate)
    futs = [b.submit(torch.randn(1, 4)) for _ in range(3)]
    b.close(timeout=0.05)
    for f in futs:
        with pytest.raises(GraphwrapError, match="closed before this request was served"):
            f.result(1)
    gate.release.set()
    t.join(10)


def test_many_threads_every_answer_is_its_own():
    model = MLP().eval()
    with Batcher(GraphedModule(model)) as b:
        def work(i):
            g = torch.Generator().manual_seed(i)
            for _ in range(40):
                n = int(torch.randint(1, 6, (1,), generator=g))
                x = torch.randn(n, 32, generator=g)
                got = b(x) if i % 2 else b.submit(x).result(10)
                assert_same(got, eager_answer(model, x), TOL)

        assert not run_threads(work, count=12)
        s = b.stats()
    assert s["requests"] == 480 and s["queued"] == 0


def test_max_delay_waits_for_a_fuller_batch():
    model = MLP().eval()
    b = Batcher(GraphedModule(model), max_delay_ms=200, max_batch_size=8)
    go = threading.Barrier(4)
    xs = [torch.randn(2, 32) for _ in range(4)]
    results = [None] * 4

    def work(i):
        go.wait()
        results[i] = b(xs[i])

    for _ in range(2):  # the first round probes, the second joins
        assert not run_threads(work, count=4)
        for x, got in zip(xs, results):
            assert_same(got, eager_answer(model, x), TOL)
    s = b.stats()
    assert s["joined_calls"] >= 1 and s["rows_per_joined_call"] == 8


def test_large_requests_are_served_alone_and_bad_arguments_refused():
    model = MLP().eval()
    b = Batcher(GraphedModule(model, max_batch_size=4))
    xs = [torch.randn(9, 32), torch.randn(1, 32)]
    for x, got in zip(xs, _gather(b, [((x,), {}) for x in xs])):
        assert_same(got, eager_answer(model, x), TOL)
    for bad in ({"max_delay_ms": -1}, {"max_delay_ms": float("inf")}, {"max_delay_ms": float("nan")},
                {"max_batch_size": 0}, {"max_queue": 0}):
        with pytest.raises(GraphwrapError):
            Batcher(GraphedModule(model), **bad)
    with pytest.raises(GraphwrapError, match="GraphedModule"):
        Batcher(model)


def test_join_verdict_and_split():
    sizes = [2, 1]
    joined = [torch.arange(6.0).view(3, 2), torch.ones(4), "c"]
    alone = [(torch.arange(4.0).view(2, 2), torch.ones(4), "c"), (torch.tensor([[4.0, 5.0]]), torch.ones(4), "c")]
    kinds, seq_dims, spec = join_verdict(joined, alone, sizes, 0)
    assert kinds == [BATCHED, WHOLE, CONST] and seq_dims == [(), (), ()]
    parts = split_outputs(joined, kinds, seq_dims, spec, sizes, [None, None], 0)
    assert torch.equal(parts[1][0], torch.tensor([[4.0, 5.0]])) and parts[1][2] == "c"
    bad = [(torch.arange(4.0).view(2, 2) + 1, torch.ones(4), "c"), alone[1]]
    assert "mixes rows" in join_verdict(joined, bad, sizes, 0).reason
    changed = [alone[0], (torch.tensor([[4.0, 5.0]]), torch.zeros(4), "c")]
    assert "mixes rows" in join_verdict(joined, changed, sizes, 0).reason
    assert type(join_verdict(flatten_outputs((torch.zeros(3, 2),))[0], alone, sizes, 0)) is Eager


def test_join_verdict_and_split_with_lengths():
    # two requests of lengths 3 and 5, joined at 5: outputs [n, L, 2] cut back to each length
    a, b = torch.randn(1, 3, 2), torch.randn(2, 5, 2)
    joined = torch.zeros(3, 5, 2)
    joined[:1, :3] = a
    joined[1:] = b
    kinds, seq_dims, spec = join_verdict([joined], [a, b], [1, 2], 0, [3, 5], 5)
    assert kinds == [BATCHED] and seq_dims == [(1,)]
    pa, pb = split_outputs([joined], kinds, seq_dims, spec, [1, 2], [3, 5], 0)
    assert torch.equal(pa, a) and torch.equal(pb, b)
    # equal lengths cannot show the sequence dims: undecided unless the key knows them
    assert join_verdict([joined[:, :3]], [a, b[:, :3]], [1, 2], 0, [3, 3], 3) is None
    assert join_verdict([joined[:, :3]], [a, b[:, :3]], [1, 2], 0, [3, 3], 3, seq_dims=[(1,)])[1] == [(1,)]
    wrong = b.clone()
    wrong[0, 4] += 1
    assert "mixes rows" in join_verdict([joined], [a, wrong], [1, 2], 0, [3, 5], 5).reason


def test_plan_groups_by_length_and_cost():
    from graphwrap.loops.joins import plan_groups

    bucket = lambda L: 16 if L <= 16 else 64  # noqa: E731
    max_rows = lambda S: 8  # noqa: E731
    cheap_long = lambda rows, S: 10.0  # one call costs the same whatever its size: join everything
    rows, lengths = [1, 2, 1, 3], [10, 60, 12, 50]
    assert plan_groups(rows, lengths, bucket, max_rows, cheap_long) == [[0, 1, 2, 3]]
    by_tokens = lambda rows, S: rows * S  # noqa: E731 - padding costs: one call per bucket
    assert plan_groups(rows, lengths, bucket, max_rows, by_tokens) == [[0, 2], [1, 3]]
    assert plan_groups(rows, lengths, bucket, lambda S: 2, cheap_long) == [[0, 2], [1], [3]]
    assert plan_groups([2, 2, 5], [None] * 3, bucket, lambda S: 4, by_tokens) == [[0, 1], [2]]


@pytest.mark.parametrize("to_host", [False, True])
def test_pipeline_coalesce_joins_items_at_hand_in_order(to_host):
    model = MLP().eval()
    gm = GraphedModule(model, max_batch_size=8)
    sizes = [1, 2, 1, 3, 9, 1, 1, 4, 4, 4, 2]
    xs = [torch.randn(n, 32) for n in sizes]
    items = xs + [(xs[0],), {"x": xs[1]}]  # other signatures (a keyword input) in between
    forwards = []
    model.register_forward_pre_hook(lambda m, a: forwards.append(1))
    outs = list(gm.pipeline(items, coalesce=True, to_host=to_host))
    assert len(outs) == len(items)
    # [1,2,1,3]: a probe (4 alone, 1 joined) then joined; [9] alone; [1,1,4], [4,4], [2,1] joined; {x} alone
    assert len(forwards) == 6 + 1 + 3 + 1
    for x, got in zip(xs + [xs[0], xs[1]], outs):
        assert_same(got, eager_answer(model, x), TOL)


def test_submit_returns_at_once_and_queued_requests_are_joined():
    import time

    gate = _Gate().eval()
    b = Batcher(GraphedModule(gate))
    gate.release.set()
    _gather(b, [((torch.randn(1, 4),), {}) for _ in range(3)])  # the probe: joined from now on
    gate.release.clear()
    gate.entered.clear()
    before = b.stats()["module_calls"]
    t = _busy(b, gate)  # the batcher is busy in the module
    xs = [torch.randn(1, 4) for _ in range(10)]
    t0 = time.perf_counter()
    futs = [b.submit(x) for x in xs]
    assert time.perf_counter() - t0 < 1.0 and not any(f.done() for f in futs)
    gate.release.set()
    for x, f in zip(xs, futs):
        assert_same(f.result(10), eager_answer(gate, x), TOL)
    t.join(10)
    assert b.stats()["module_calls"] - before == 2, "the busy one, then the ten queued ones joined"


def test_submit_on_an_idle_batcher_is_served_by_the_worker():
    model = MLP().eval()
    b = Batcher(GraphedModule(model))
    x = torch.randn(2, 32)
    fut = b.submit(x)
    assert_same(fut.result(10), eager_answer(model, x), TOL)
    b.close()


def test_requests_of_different_lengths_are_joined_padded_and_each_gets_its_own():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(30, 8)

        def forward(self, ids, mask):
            h = self.emb(ids)
            m = mask.unsqueeze(-1).float()
            return h + (h * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)

    model = Masked().eval()
    b = Batcher(GraphedModule(model, seq_dim=1))
    for _ in range(3):
        calls = []
        for n, L in ((1, 5), (2, 9), (1, 30), (3, 7), (1, 5)):
            calls.append(((torch.randint(1, 30, (n, L)), torch.ones(n, L, dtype=torch.long)), {}))
        outs = _gather(b, calls)
        for (a, k), got in zip(calls, outs):
            assert got.shape == a[0].shape + (8,)
            assert_same(got, eager_answer(model, *a), TOL)
    s = b.stats()
    assert s["probes"] == 1 and s["joined_calls"] >= 2
