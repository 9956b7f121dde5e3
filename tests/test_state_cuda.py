"""State besides the inputs, on a GPU: calls under inference_mode, the module changed after
capture, a forward that writes its own buffers, and the CUDA generator after captures."""

import asyncio
import threading

import pytest
import torch
from helpers import MLP, Counter, RowCache, TensorCache, assert_same, eager_answer, replays
from torch import nn

from graphwrap import Batcher, GraphedModule

pytestmark = pytest.mark.cuda
DEV = "cuda"


def test_inference_mode_for_calls_views_pipelines_and_the_batcher_then_outside_it():
    model = MLP().to(DEV).eval()
    gm, gv = GraphedModule(model), GraphedModule(model, outputs="view")
    with torch.inference_mode():
        for n in (3, 5, 17, 3, 64):
            x = torch.randn(n, 32, device=DEV)
            assert_same(gm(x), model(x))
            assert_same(gv(x).clone(), model(x))
        xs = [torch.randn(n, 32) for n in (3, 9, 3, 40)]
        for x, out in zip(xs, gm.pipeline(xs)):
            assert_same(out, model(x.to(DEV)))
        b = Batcher(gm)
        try:
            xs = [torch.randn(2, 32, device=DEV) for _ in range(8)]
            for x, fut in zip(xs, [b.submit(x) for x in xs]):
                assert_same(fut.result(), model(x))
        finally:
            b.close()
    for n in (3, 5, 17):  # buffers made under inference_mode take writes outside it
        x = torch.randn(n, 32, device=DEV)
        assert_same(gm(x), eager_answer(model, x))
        assert_same(gv(x).clone(), eager_answer(model, x))
    assert gm.stats()["eager_calls"] == {} and replays(gm) > 0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.act(self.fc(x))) * 2 + torch.ones(1, device=x.device)


@pytest.mark.parametrize("change", ["swap a submodule without weights", "add a forward hook",
                                    "remove a hook present at capture", "a submodule put in training mode",
                                    "a new default dtype"])
def test_each_change_to_the_module_after_capture_is_seen_before_the_next_replay(change):
    model = Net().to(DEV).eval()
    handle = model.fc.register_forward_hook(lambda m, i, o: o + 1) if "remove" in change else None
    gm = GraphedModule(model, eager_if_faster=False)
    x = torch.randn(8, 64, device=DEV)
    for _ in range(2):
        assert_same(gm(x), eager_answer(model, x))
    if change == "swap a submodule without weights":
        model.act = nn.Tanh().eval()
    elif change == "add a forward hook":
        model.act.register_forward_hook(lambda m, i, o: o * 3)
    elif change == "remove a hook present at capture":
        handle.remove()
    elif change == "a submodule put in training mode":
        model.drop.train()
    else:
        torch.set_default_dtype(torch.float64)
    try:
        if change == "a submodule put in training mode":
            evaluated = 2 * torch.relu(model.fc(x)) + 1
            got = gm(x)
            assert not torch.allclose(got, evaluated), "dropout ran as in training"
            assert gm.stats()["eager_calls"]
        else:
            got, want = gm(x), eager_answer(model, x)
            assert_same(got, want)
            assert replays(gm) == 1, "captured again and served by the new graph"
        assert len(gm.stats()["module_changes"]) == 1
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_counter_in_a_buffer_counts_each_call_once():
    model, ref = Counter(16).to(DEV).eval(), Counter(16).to(DEV).eval()
    ref.load_state_dict(model.state_dict())
    gm = GraphedModule(model)
    for _ in range(6):
        x = torch.randn(3, 16, device=DEV)
        assert_same(gm(x), eager_answer(ref, x))
    assert int(model.steps) == 6 == int(ref.steps)
    assert gm.stats()["writes_buffers"] == ["steps"]


def test_a_cache_in_buffers_written_in_place_by_the_graphs_matcheseager_answer():
    model, ref = RowCache(rows=16, d=32).to(DEV).eval(), RowCache(rows=16, d=32).to(DEV).eval()
    ref.load_state_dict(model.state_dict())
    gm = GraphedModule(model)
    for n in (3, 3, 5, 3, 5, 16, 2, 2, 2):
        x = torch.randn(n, 32, device=DEV)
        assert_same(gm(x), eager_answer(ref, x))
        assert torch.equal(model.last, ref.last), f"the cache after a call of {n} rows"
    assert replays(gm) >= 3, "the calls replay graphs"


class StepCache(nn.Module):
    """A decoder step with a fixed-batch cache in buffers, written at ``pos`` (gpt-fast style)."""

    def __init__(self, batch=2, length=8, d=16):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.register_buffer("k", torch.zeros(batch, length, d))

    def forward(self, x, pos):
        self.k.index_copy_(1, pos, self.proj(x))
        return self.k.sum(1)


def test_a_fixed_batch_cache_gets_the_modules_answers_and_state():
    model, ref = StepCache().to(DEV).eval(), StepCache().to(DEV).eval()
    ref.load_state_dict(model.state_dict())
    gm = GraphedModule(model, batch_dim={"pos": None})
    for p in range(5):
        x, pos = torch.randn(2, 1, 16, device=DEV), torch.tensor([p], device=DEV)
        assert_same(gm(x, pos), eager_answer(ref, x, pos))
        assert torch.equal(model.k, ref.k)


def _draws(stop, failures, count):
    while not stop.is_set():
        try:
            torch.randn(64, device=DEV)
        except RuntimeError as e:
            failures.append(str(e))
        count[0] += 1


def test_the_cuda_generator_is_usable_after_captures_that_other_threads_drew_during():
    # The sequence that once left every later draw failing: a Batcher served by 64 threads,
    # lazy captures while a user thread draws, 64 coroutines on a third module's Batcher.
    model = MLP().to(DEV).eval()
    b1 = Batcher(GraphedModule(model))
    try:
        def client(i):
            for k in range(20):
                x = torch.randn(1 + (i + k) % 7, 32)
                out = b1(x if i % 2 else x.to(DEV))
                assert out.shape == (x.shape[0], 16)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        b1.close()
    gm2 = GraphedModule(MLP().to(DEV).eval())
    stop, failures, count = threading.Event(), [], [0]
    drawer = threading.Thread(target=_draws, args=(stop, failures, count))
    drawer.start()
    try:
        for n in list(range(1, 65)) + [100, 200, 256]:
            gm2(torch.randn(n, 32, device=DEV))
    finally:
        stop.set()
        drawer.join()
    print(f"\nwhile 16 buckets were captured: {len(failures)} failed draws of {count[0]} in another thread")
    b3 = Batcher(GraphedModule(MLP().to(DEV).eval()))

    async def coroutines():
        async def one(i):
            for k in range(20):
                await b3.acall(torch.randn(1 + (i + k) % 5, 32, device=DEV))
        await asyncio.gather(*(one(i) for i in range(64)))

    try:
        asyncio.run(coroutines())
    finally:
        b3.close()
    for _ in range(100):
        torch.randn(16, device=DEV)
    torch.cuda.synchronize()


def test_a_cache_tensor_declared_as_state_is_written_by_the_graphs_where_it_lives():
    torch.manual_seed(0)
    model = TensorCache().to(DEV).eval()
    gm = GraphedModule(model, state=["cache"], batch_dim={"pos": None})
    mine, ref = torch.zeros(2, 16, 8, device=DEV), torch.zeros(2, 16, 8, device=DEV)
    with torch.no_grad():
        for p in range(12):
            x, pos = torch.randn(2, 1, 8, device=DEV), torch.tensor([p], device=DEV)
            assert_same(gm(x, mine, pos), model(x, ref, pos))
            assert torch.allclose(mine, ref, atol=1e-6), p
    (key,) = gm.stats()["keys"]
    assert key["buckets"][1]["serves"] == "graph" and replays(gm) >= 10, key


class _ScaledOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.scale_output = True

    def forward(self, x):
        y = self.fc(x)
        return y * 4 if self.scale_output else y


def test_a_plain_attribute_changed_after_capture_is_seen_before_the_next_replay():
    model = _ScaledOutput().to(DEV).eval()
    gm = GraphedModule(model)
    x = torch.randn(4, 32, device=DEV)
    assert_same(gm(x), eager_answer(model, x))
    model.scale_output = False  # the graph captured the branch that scales
    for _ in range(5):
        x = torch.randn(4, 32, device=DEV)
        assert_same(gm(x), eager_answer(model, x))
    assert gm.stats()["module_changes"] == {"attribute 'scale_output' of the module changed from True to False": 1}
    assert replays(gm) >= 5
