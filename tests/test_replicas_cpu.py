"""Replicas on the CPU: answers, the factory, arguments, and the spreading rule."""

import asyncio

import pytest
import torch
from helpers import MLP, assert_same

from graphwrap import GraphwrapError, Replicas
from graphwrap.serve.replicas import _Replica


def test_answers_equal_eager_through_every_call():
    model = MLP().eval()
    with Replicas(model, devices=["cpu"]) as reps:
        x = torch.randn(3, 32)
        with torch.no_grad():
            want = model(x)
        assert_same(reps(x), want, 1e-5)
        assert_same(reps.submit(x).result(10), want, 1e-5)

        async def main():
            return await asyncio.gather(*(reps.acall(x) for _ in range(4)))

        for got in asyncio.run(main()):
            assert_same(got, want, 1e-5)
        assert reps.stats()["cpu"]["batcher"]["requests"] == 6 and reps.stats()["cpu"]["inflight"] == 0


def test_a_factory_builds_each_replica_and_bad_arguments_are_refused():
    built = []

    def factory(device):
        built.append(device)
        return MLP().eval().to(device)

    reps = Replicas(factory, devices=["cpu"])
    assert built == [torch.device("cpu")] and reps.devices == [torch.device("cpu")]
    with pytest.raises(GraphwrapError, match="must differ"):
        Replicas(MLP(), devices=["cpu", "cpu"])
    with pytest.raises(GraphwrapError, match="not an nn.Module"):
        Replicas(lambda d: 3, devices=["cpu"])
    with pytest.raises(GraphwrapError, match="nn.Module or a factory"):
        Replicas(3, devices=["cpu"])
    with pytest.raises(GraphwrapError, match=r"devices must be a list of devices, such as .*got 'cpu'"):
        Replicas(MLP(), devices="cpu")
    with pytest.raises(GraphwrapError, match="'gpu0' is not a device"):
        Replicas(MLP(), devices=["gpu0"])
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(GraphwrapError, match=f"cuda:{count} is not here .*sees {count} CUDA devices"):
        Replicas(MLP(), devices=[f"cuda:{count}"])


def test_requests_go_to_the_replica_with_the_fewest_in_flight():
    reps = Replicas(MLP().eval(), devices=["cpu"])
    a = reps._replicas[0]
    b = _Replica(torch.device("cpu"), a.gm, a.batcher)
    reps._replicas.append(b)
    first, second = reps._pick(), reps._pick()
    assert {id(first), id(second)} == {id(a), id(b)}, "one each while both are busy"
    a.inflight += 3
    assert reps._pick() is b and reps._pick() is b
    assert b.inflight == 3 and a.inflight == 4
