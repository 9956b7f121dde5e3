"""The drop-in promise on a GPU: forwards that write into their inputs, random numbers in other
threads during captures, inputs that are not batched, copies and pickles, and a capture that
never keeps another module's callers waiting."""

import copy
import io
import pickle
import threading
import time

import pytest
import torch
from helpers import MLP, Scales, Slow, assert_same, eager_answer, num_graphs, small_bert
from torch import nn

from graphwrap import Batcher, GraphedModule

pytestmark = pytest.mark.cuda
DEV = "cuda"


class WritesCache(nn.Module):
    """Writes each step into a cache tensor the caller passes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, cache, t: int):
        cache[:, t] = self.lin(x)
        return cache.sum(1)


def test_a_forward_that_writes_into_its_input_gets_eagers_answer_and_leaves_the_tensor_as_eager_does():
    model = Scales(64).to(DEV).eval()
    gm = GraphedModule(model)
    for n in (3, 3, 5, 1):
        x = torch.rand(n, 64, device=DEV) * 255
        x_eager = x.clone()
        want = eager_answer(model, x_eager)
        got = gm(x)
        assert_same(got, want)
        assert_same(x, x_eager)  # divided once, as eager divides it
    k = gm.stats()["keys"][0]
    assert k["status"] == "eager" and "writes into its input" in k["reason"], k
    assert num_graphs(gm) == 0


def test_a_forward_that_writes_into_a_cache_it_is_passed_runs_eagerly():
    model = WritesCache().to(DEV).eval()
    gm = GraphedModule(model)
    cache, cache_eager = torch.zeros(2, 5, 16, device=DEV), torch.zeros(2, 5, 16, device=DEV)
    for t in range(5):
        x = torch.randn(2, 16, device=DEV)
        assert_same(gm(x, cache, t), eager_answer(model, x, cache_eager, t))
        assert_same(cache, cache_eager)
    assert all("writes into its input cache" in k["reason"] for k in gm.stats()["keys"])


def _deep(width=64, layers=40):
    """Many kernels: a capture long enough to meet a draw from another thread."""
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(DEV).eval()


class _Draws:
    """Draws from the default CUDA generator in a thread of its own, counting what fails."""

    def __init__(self):
        self.stop, self.draws, self.failed, self.other = threading.Event(), 0, 0, []
        self.thread = threading.Thread(target=self._run)

    def _run(self):
        while not self.stop.is_set():
            try:
                torch.randn(256, device=DEV).sum()
            except RuntimeError as e:
                if "Offset increment outside graph capture" not in str(e):
                    self.other.append(e)
                    return
                self.failed += 1
            self.draws += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(60)


def _capture_while_drawing(buckets):
    model = _deep()
    gm = GraphedModule(model, buckets=buckets, eager_if_faster=False)
    with _Draws() as d:
        for n in buckets:
            x = torch.randn(n, 64, device=DEV, generator=torch.Generator(device=DEV).manual_seed(n))
            assert_same(gm(x), eager_answer(model, x), tol=1e-4)
    assert not d.other, d.other[:2]
    assert num_graphs(gm) == len(buckets)
    return d


def test_random_numbers_in_another_thread_while_buckets_are_captured(monkeypatch):
    import graphwrap.capture.cuda
    from graphwrap._compat import PER_CAPTURE_RNG

    buckets = list(range(1, 25))
    kept_apart = _capture_while_drawing(buckets)
    monkeypatch.setattr(graphwrap.capture.cuda, "_GRAPHSAFE", False)  # as PyTorch captures
    plain = _capture_while_drawing(buckets)
    print(f"\ndraws from another thread during {len(buckets)} captures (and their slots): failed "
          f"{kept_apart.failed} of {kept_apart.draws} with the generator kept apart, {plain.failed} of "
          f"{plain.draws} without")
    if PER_CAPTURE_RNG:
        assert kept_apart.failed == plain.failed == 0
    else:
        # Only while a capture begins, not for the whole capture.
        assert kept_apart.failed * 5 <= max(plain.failed, 5)


def test_random_numbers_in_the_main_thread_while_a_background_capture_runs():
    from graphwrap._compat import PER_CAPTURE_RNG

    model = _deep()
    gm = GraphedModule(model, max_batch_size=64, eager_if_faster=False)
    gm.capture(torch.randn(4, 64, device=DEV), background=True)
    draws = failed = 0
    t0 = time.perf_counter()
    while not gm.wait(0) and time.perf_counter() - t0 < 120:
        try:
            torch.randn(1024, device=DEV).sum()
        except RuntimeError as e:
            assert "Offset increment outside graph capture" in str(e)
            failed += 1
        draws += 1
    assert gm.wait(120) and draws > 0
    print(f"\nmain-thread draws during a background capture of {len(gm.buckets)} buckets: {failed} of {draws} failed")
    assert failed == 0 if PER_CAPTURE_RNG else failed * 100 <= draws
    assert num_graphs(gm) == len(gm.buckets)
    x = torch.randn(7, 64, device=DEV)
    assert_same(gm(x), eager_answer(model, x), tol=1e-4)


class UsesRandom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + 0 * torch.rand_like(x)


def test_a_forward_that_draws_random_numbers_still_gets_eagers_answer():
    model = UsesRandom().to(DEV).eval()
    gm = GraphedModule(model, buckets=[4])
    for n in (2, 4):
        x = torch.randn(n, 8, device=DEV)
        assert_same(gm(x), eager_answer(model, x))


class AddsPosition(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.table = nn.Embedding(32, 16)

    def forward(self, x, pos):
        return self.lin(x) + self.table(pos)


def test_inputs_that_are_not_batched():
    model = AddsPosition().to(DEV).eval()
    gm = GraphedModule(model)
    for n in (1, 3, 8, 5):
        x, pos = torch.randn(n, 16, device=DEV), torch.randint(0, 32, (1,), device=DEV)
        assert_same(gm(x, pos), eager_answer(model, x, pos))
    s = gm.stats()
    assert s["eager_calls"] == {}, s["eager_calls"]
    assert any("Tensor[1] int64" in k["key"] for k in s["keys"])
    named = GraphedModule(model, batch_dim={"pos": None})
    for n in (2, 6):
        x, pos = torch.randn(n, 16, device=DEV), torch.randint(0, 32, (n,), device=DEV)[:1]
        assert_same(named(x, pos=pos), eager_answer(model, x, pos=pos))
    assert named.stats()["eager_calls"] == {}


def test_copies_and_pickles_capture_their_own():
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, max_batch_size=16)
    x = torch.randn(5, 32, device=DEV)
    want = eager_answer(model, x)
    assert_same(gm(x), want)
    twin = copy.deepcopy(gm)
    assert twin.module is not model and num_graphs(twin) == 0
    assert_same(twin(x), want)
    assert num_graphs(twin) == 1 and num_graphs(gm) == 1
    buf = io.BytesIO()
    torch.save(gm, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert_same(loaded(x), want)
    assert_same(pickle.loads(pickle.dumps(gm))(x), want)
    with torch.no_grad():
        twin.module.layers[0].weight.add_(1.0)
    assert_same(gm(x), want)  # the copy's weights are its own


def test_submit_returns_at_once_and_requests_are_joined():
    model = Slow(32, 50).to(DEV).eval()
    b = Batcher(GraphedModule(model, max_batch_size=64), max_delay_ms=50)
    xs = [torch.randn(1, 32, device=DEV) for _ in range(100)]
    t0 = time.perf_counter()
    futs = [b.submit(x) for x in xs]
    submit_s = time.perf_counter() - t0
    for x, f in zip(xs, futs):
        assert_same(f.result(60), eager_answer(model, x))
    s = b.stats()
    b.close()
    print(f"\n100 submits from one thread: {submit_s * 1e3:.1f} ms to submit, {s['module_calls']} module calls, "
          f"{s['joined_calls']} joined")
    assert submit_s < 1.0 and s["joined_calls"] >= 1 and s["module_calls"] < 100


def test_a_module_answers_calls_that_need_new_output_slots_while_another_compiles():
    tr = pytest.importorskip("transformers")
    a_model = MLP().to(DEV).eval()
    a = GraphedModule(a_model, buckets=[4])
    x = torch.randn(3, 32, device=DEV)
    a(x)
    bert, cfg = small_bert(tr, DEV)
    b = GraphedModule(bert, buckets=[8], compile=True)
    ids = torch.randint(0, cfg.vocab_size, (8, 16), device=DEV)
    compiling = threading.Thread(target=lambda: b(ids))
    t_start = time.perf_counter()
    compiling.start()
    time.sleep(0.5)  # into the compile, which holds the process's capture lock
    held, took = [], []
    while compiling.is_alive() and len(held) < 200:
        t0 = time.perf_counter()
        held.append(a(x))  # each held: every call needs a slot no earlier output occupies
        torch.cuda.current_stream().synchronize()
        took.append(time.perf_counter() - t0)
    worst, median = max(took), sorted(took)[len(took) // 2]
    compiling.join(600)
    compile_s = time.perf_counter() - t_start
    want = eager_answer(a_model, x)
    for h in held:
        assert_same(h, want)
    print(f"\nwhile another module compiled for {compile_s:.1f} s: {len(held)} calls, median {median * 1e3:.2f} ms, "
          f"slowest {worst * 1e3:.2f} ms")
    # What is asserted is behaviour: calls were answered while the compile ran, and none of them
    # waited for it to end (no call waits for the capture lock the compile holds). How long they
    # took, the GIL shared with the compile, is a figure for the benchmarks, printed above.
    assert len(held) >= 10, "calls were not answered while the other module compiled"
    assert worst < compile_s / 2, "a call waited for the other module's compile"


def test_outputs_the_caller_keeps_are_its_own_whichever_path_serves_them():
    for model in (nn.Linear(64, 64), MLP()):
        model = model.to(DEV).eval()
        gm = GraphedModule(model)
        width = 64 if isinstance(model, nn.Linear) else 32
        xs = [torch.randn(1, width, device=DEV) for _ in range(300)]
        kept = [gm(x) for x in xs]
        for x, out in zip(xs, kept):
            assert_same(out, eager_answer(model, x))
        assert len({o.data_ptr() for o in kept}) == len(kept)
        b = gm.stats()["keys"][0]["buckets"][1]
        print(f"\n{type(model).__name__}: {b['serves']}, eager when held: {b['eager_when_held']} "
              f"(eager {b['eager_us']}, replay and clone {b['held_us']}, with a slot {b['graph_us']} us), "
              f"{b['eager_held_calls']} calls eager when held, {b['replays']} replays")
