"""Replicas on every GPU of the host (needs two): answers equal eager, every replica used."""

import pytest
import torch
from helpers import MLP, run_threads

from graphwrap import Replicas

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def test_two_gpus_answer_as_eager_and_share_the_load():
    model = MLP().eval()
    with Replicas(model) as reps:
        assert [str(d) for d in reps.devices][:2] == ["cuda:0", "cuda:1"]

        def work(i):
            g = torch.Generator().manual_seed(i)
            for k in range(200):
                n = int(torch.randint(1, 6, (1,), generator=g))
                x = torch.randn(n, 32, generator=g)
                x = x.to("cuda:0") if k % 3 == 0 else x
                got = reps(x)
                with torch.no_grad():
                    want = model(x.cpu())
                torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)

        assert not run_threads(work, count=32)
        s = reps.stats()
    served = {dev: v["batcher"]["requests"] for dev, v in s.items()}
    print(f"\nreplicas: requests served per device {served}")
    assert sum(served.values()) == 32 * 200 and all(v > 0 for v in served.values())
