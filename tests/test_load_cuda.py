"""Load and faults on a GPU: many threads, out-of-memory inside capture, a second GPU."""

import gc
import random
import threading

import pytest
import torch
from helpers import MLP, assert_same

from graphwrap import GraphedModule, GraphwrapError

pytestmark = pytest.mark.cuda
DEV = "cuda"
THREADS, CALLS = 8, 10_000


def test_eight_threads_ten_thousand_calls_each():
    model = MLP().to(DEV).eval()
    # Graphs for every bucket, whatever the race against eager would say under this load:
    # the point here is every replay's answer and memory under load.
    gm = GraphedModule(model, max_batch_size=64, eager_if_faster=False)
    worst = [None] * THREADS
    errors = []
    # Memory is taken with every thread's stream made and warm (each stream that runs a GEMM
    # keeps a cuBLAS workspace), after the first half of the calls and at the end: the second
    # half must not grow it (no memory per call). The first half may add the workspace of a
    # stream that first runs a GEMM in it (a new output slot's capture on the engine's worker).
    barriers = [threading.Barrier(THREADS + 1) for _ in range(3)]
    half = CALLS // 2

    def calls(rng, g, count, diff):
        for _ in range(count):
            n = rng.randint(1, 80)  # above 64: split over two replays
            x = torch.randn(n, 32, device=DEV, generator=g) * rng.choice((0.01, 1.0, 100.0))
            got, want = gm(x), model(x)
            diff = torch.maximum(diff, ((got - want).abs() / (want.abs() + 1)).max())
        return diff

    def work(i):
        rng = random.Random(i)
        g = torch.Generator(device=DEV).manual_seed(i)
        diff = torch.zeros((), device=DEV)
        try:
            with torch.no_grad(), torch.cuda.stream(torch.cuda.Stream()):
                for count, barrier in zip((100, half - 100, CALLS - half), barriers):
                    diff = calls(rng, g, count, diff)
                    torch.cuda.current_stream().synchronize()
                    barrier.wait()
                worst[i] = float(diff)  # one host sync per thread: the loop itself never waits
        except Exception as e:  # noqa: BLE001 - asserted on below
            errors.append(e)
            for b in barriers:
                b.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    marks, large = [], []
    try:
        for b in barriers:
            b.wait()
            torch.cuda.synchronize()
            marks.append(torch.cuda.memory_allocated())
            large.append(_large_blocks())
    except threading.BrokenBarrierError:
        pass
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    s = gm.stats()
    print(f"\nload: {THREADS} threads x {CALLS} calls on {torch.cuda.get_device_name()}: errors {len(errors)}, "
          f"worst relative difference {max(worst):.2e}, rows {s['rows']}, device allocated after warm-up, "
          f"half and all calls: {', '.join(f'{m / 2**20:.1f}' for m in marks)} MiB; "
          f"reserved {torch.cuda.memory_reserved() / 2**20:.1f} MiB; blocks of 1 MiB or more made in the "
          f"first half (stream, MiB): {sorted(set(large[1]) - set(large[0])) if len(large) > 1 else None}")
    assert all(w is not None and w < 1e-4 for w in worst), worst
    assert s["eager_calls"] == {}
    # Every call replayed, but those that came while their bucket was being captured by
    # another thread: those ran eagerly meanwhile, and are counted as such.
    k = s["keys"][0]
    assert sum(b["replays"] for b in k["buckets"].values()) + k["eager_while_warming"] >= THREADS * CALLS
    assert marks[2] - marks[1] <= 4 << 20
    assert marks[1] - marks[0] <= (4 << 20) + (64 << 20)


def _large_blocks():
    """(stream, MiB, address) of the live blocks of 1 MiB or more."""
    return [(seg["stream"], blk["size"] >> 20, blk["address"]) for seg in torch.cuda.memory_snapshot()
            for blk in seg["blocks"] if blk["state"] == "active_allocated" and blk["size"] >= 1 << 20]


class _Greedy(torch.nn.Module):
    """Asks for more memory than the device has, at one moment of its life only."""

    def __init__(self, when):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.when = when

    def forward(self, x):
        y = self.lin(x)
        capturing = torch.cuda.is_current_stream_capturing()
        if (self.when == "capture" and capturing) or (self.when == "warmup" and x.shape[0] == 8 and not capturing):
            y = y + torch.empty(1 << 50, dtype=torch.uint8, device=x.device)[: y.numel()].view_as(y).zero_()
        return y


def _warm_capture_streams(count: int):
    """Capture streams, and the cuBLAS workspace each keeps per capturing thread, stay for the
    process (as many as pools alive at once): make the ones a test needs before its baseline."""
    gms = [GraphedModule(MLP().to(DEV).eval(), buckets=[4]) for _ in range(count)]
    with torch.no_grad():
        for g in gms:
            g(torch.randn(3, 32, device=DEV))
    del gms, g
    gc.collect()


@pytest.mark.parametrize("when", ["capture", "warmup"])
def test_out_of_memory_during_capture_falls_back_and_recovers(when, gw_log):
    _warm_capture_streams(2)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    model = _Greedy(when).to(DEV).eval()
    gm = GraphedModule(model, buckets=[8, 16])
    x = torch.randn(5, 16, device=DEV)
    with torch.no_grad():
        want = model.lin(x)
    assert_same(gm(x), want)  # served eagerly: the eager run of 5 rows asks for nothing
    b = gm.stats()["keys"][0]["buckets"][8]
    assert not b["captured"] and f"out of memory in {'capture' if when == 'capture' else 'warm-up'}" in b["failed"]
    assert b["eager_calls"] == 1
    assert any("out of memory" in r.message for r in gw_log.records)
    # The process goes on: random numbers, a new capture, and other buckets of this module.
    torch.randn(4, device=DEV).sum().item()
    model.when = None
    other = GraphedModule(MLP().to(DEV).eval(), buckets=[4])
    xo = torch.randn(3, 32, device=DEV)
    with torch.no_grad():
        assert_same(other(xo), other.module(xo))
    x16 = torch.randn(12, 16, device=DEV)
    with torch.no_grad():
        assert_same(gm(x16), model.lin(x16))
    assert gm.stats()["keys"][0]["buckets"][16]["captured"]
    del gm, other, model
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() - base <= 1 << 20


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_inputs_on_another_gpu():
    model = MLP().to("cuda:0").eval()
    gm = GraphedModule(model, buckets=[4])
    with pytest.raises(GraphwrapError, match=r"on cuda:1 but the module is on cuda:0.*\.to\('cuda:0'\)"):
        gm(torch.randn(3, 32, device="cuda:1"))
    x = torch.randn(3, 32, device="cuda:0")
    with torch.no_grad():
        assert_same(gm(x), model(x))
    # The module moved to the second GPU: graphs are captured again there.
    gm.to("cuda:1")
    x1 = x.to("cuda:1")
    with torch.no_grad():
        assert_same(gm(x1), model(x1))
    assert gm.stats()["device"] == "cuda:1"
