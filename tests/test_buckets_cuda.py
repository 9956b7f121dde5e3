"""Buckets on a GPU: every bucket and past the largest, the default policy, capture of every bucket, memory given back. Every call gets fresh random inputs and is compared with eager."""

import pytest
import torch
from helpers import (
    assert_same,
    eager_answer,
    gpu_mlp,
    num_graphs,
    run_threads,
)

from graphwrap import GraphedModule, default_buckets

pytestmark = pytest.mark.cuda
DEV = "cuda"


def test_every_bucket_and_past_the_largest():
    model = gpu_mlp()
    gm = GraphedModule(model, buckets=[1, 2, 4, 8, 16])
    for n in list(range(1, 40)) + [3, 1, 17, 16]:
        x = torch.randn(n, 32, device=DEV)
        assert_same(gm(x), eager_answer(model, x))
    s = gm.stats()
    assert s["eager_calls"] == {}
    # above the largest bucket, graphs of the grid continued: 24, 32, 40
    assert sorted(s["keys"][0]["buckets"]) == [1, 2, 4, 8, 16, 24, 32, 40] and num_graphs(gm) == 8
    assert s["rows"] == sum(list(range(1, 40)) + [3, 1, 17, 16])


def test_default_buckets_random_sizes():
    model = gpu_mlp()
    gm = GraphedModule(model)
    for n in torch.randint(1, 300, (40,)).tolist():
        x = torch.randn(n, 32, device=DEV)
        assert_same(gm(x), eager_answer(model, x))
    assert gm.stats()["eager_calls"] == {}


def _settle():
    """Memory as it stands with no cuBLAS workspace held: each capture clears the workspaces
    (see graphwrap.capture.graph), and the next GEMM on each stream makes its own again, so how
    many exist at a given moment says nothing about the graphs."""
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def test_explicit_capture_logs_progress_and_memory_is_shared(gw_log):
    model = gpu_mlp(d_in=256, hidden=1024, d_out=256)
    x = torch.randn(3, 256, device=DEV)
    gm = GraphedModule(model)
    ks = gm.capture(x)
    assert all(b["captured"] for b in ks["buckets"].values())
    assert len(ks["buckets"]) == len(default_buckets())
    assert sum("captured bucket" in r.message for r in gw_log.records) == len(default_buckets())
    all_pool = gm.stats()["graph_pool_bytes"]
    one = GraphedModule(model, buckets=[256])
    one.capture(x)
    largest = one.stats()["graph_pool_bytes"]
    print(f"\ngraph pool: all {len(default_buckets())} default buckets {all_pool / 2**20:.1f} MiB, "
          f"largest bucket alone {largest / 2**20:.1f} MiB, ratio {all_pool / max(largest, 1):.2f}")
    assert all_pool <= 3 * max(largest, 2**21)
    for n in (1, 5, 100, 256):
        x = torch.randn(n, 256, device=DEV)
        assert_same(gm(x), eager_answer(model, x))


def test_deleting_gives_memory_back():
    model = gpu_mlp(d_in=256, hidden=1024, d_out=256)

    # A first capture makes the streams, handles and caches that the process keeps.
    gm = GraphedModule(model, buckets=[64, 128, 256])
    gm.capture(torch.randn(4, 256, device=DEV))
    torch.cuda.synchronize()
    del gm
    _settle()
    base = torch.cuda.memory_allocated()
    base_reserved = torch.cuda.memory_reserved()
    gm = GraphedModule(model, buckets=[64, 128, 256])
    gm.capture(torch.randn(4, 256, device=DEV))
    _settle()
    held = torch.cuda.memory_allocated() - base
    held_reserved = torch.cuda.memory_reserved() - base_reserved
    del gm
    _settle()
    left = torch.cuda.memory_allocated() - base
    left_reserved = torch.cuda.memory_reserved() - base_reserved
    print(f"\nGraphedModule held {held / 2**20:.2f} MiB allocated, {held_reserved / 2**20:.2f} MiB reserved; "
          f"after del {left / 2**20:.2f} MiB, {left_reserved / 2**20:.2f} MiB")
    assert held > 0
    assert left <= 0 and left_reserved <= 0


def test_threads_share_one_module():
    model = gpu_mlp()
    gm = GraphedModule(model, buckets=[1, 2, 4, 8, 16, 32])

    def work(seed):
        g = torch.Generator(device="cpu").manual_seed(seed)
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(100):
                n = int(torch.randint(1, 40, (1,), generator=g))
                x = torch.randn(n, 32, generator=g).to(DEV)
                assert_same(gm(x), eager_answer(model, x))

    errors = run_threads(work)
    assert not errors, errors[:3]
    assert gm.stats()["eager_calls"] == {}
