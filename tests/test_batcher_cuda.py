"""The Batcher and pipeline(coalesce=True) on a GPU: every answer checked against eager."""

import asyncio
import random

import pytest
import torch
from helpers import MLP, RowMixer, assert_same, run_threads

from graphwrap import Batcher, GraphedModule

pytestmark = pytest.mark.cuda
DEV = "cuda"


def test_64_threads_1000_random_requests_each():
    model = MLP().to(DEV).eval()
    b = Batcher(GraphedModule(model, max_batch_size=64))
    worst = [0.0] * 64

    def work(i):
        rng = random.Random(i)
        g = torch.Generator(device=DEV).manual_seed(i)
        with torch.no_grad():
            for k in range(1000):
                n = rng.randint(1, 8)
                x = torch.randn(n, 32, device=DEV, generator=g)
                got = b(x) if k % 2 else b.submit(x).result(30)
                want = model(x)
                assert got.shape == want.shape
                worst[i] = max(worst[i], float(((got - want).abs() / (want.abs() + 1)).max()))

    errors = run_threads(work, count=64)
    s = b.stats()
    b.close()
    print(f"\nbatcher: 64 threads x 1000 requests: errors {len(errors)}, worst relative difference "
          f"{max(worst):.2e}, {s['joined_calls']} joined calls, {s['rows_per_joined_call']:.1f} rows each, "
          f"{s['alone_calls']} alone")
    assert not errors, errors[:3]
    assert max(worst) < 1e-4
    assert s["requests"] == 64_000 and s["joined_calls"] > 0


def test_host_inputs_and_asyncio():
    model = MLP().to(DEV).eval()
    b = Batcher(GraphedModule(model))
    for pinned in (True, False, True):
        xs = [torch.randn(n, 32) for n in (1, 4, 2, 7, 1)]
        xs = [x.pin_memory() for x in xs] if pinned else xs

        async def main():
            return await asyncio.gather(*(b.acall(x) for x in xs))

        for x, got in zip(xs, asyncio.run(main())):
            assert got.is_cuda
            with torch.no_grad():
                assert_same(got, model(x.to(DEV)), 1e-5)
    assert b.stats()["joined_calls"] >= 1


def test_a_row_mixing_model_is_never_joined():
    model = RowMixer().to(DEV).eval()
    b = Batcher(GraphedModule(model))
    for _ in range(3):
        xs = [torch.randn(n, 8, device=DEV) for n in (2, 3, 1, 4)]

        async def main():
            return await asyncio.gather(*(b.acall(x) for x in xs))

        for x, got in zip(xs, asyncio.run(main())):
            with torch.no_grad():
                assert_same(got, model(x), 1e-5)
    s = b.stats()
    assert s["joined_calls"] == 0 and s["alone_calls"] == 12


def test_pipeline_coalesce_2000_mixed_items():
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model)
    rng = random.Random(0)
    sizes = [rng.choice((1, 1, 1, 2, 3, 16)) if i % 100 else 300 for i in range(2000)]
    xs = [torch.randn(n, 32).pin_memory() for n in sizes]
    outs = list(gm.pipeline(xs, coalesce=True))
    assert len(outs) == len(xs)
    with torch.no_grad():
        for x, got in zip(xs, outs):
            assert_same(got, model(x.to(DEV)), 1e-5)
    replays = sum(b["replays"] for b in gm.stats()["keys"][0]["buckets"].values())
    assert replays < len(xs) // 4, replays
