"""graphwrap.serve on a local Ray instance (the CPU: eager calls): HTTP and handles, errors, recovery.

Ray is a dependency of this test only (CI installs it: pip install "graphwrap[serve]")."""

import json
import os
import socket
import urllib.error
import urllib.request

import pytest
import torch

ray = pytest.importorskip("ray", reason='needs Ray Serve: pip install "graphwrap[serve]"')
serve = pytest.importorskip("ray.serve")

from serve_models import make  # noqa: E402

import graphwrap.serve  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/gw", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def served():
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    handle = serve.run(graphwrap.serve.deployment(make, sample=torch.randn(1, 4), num_gpus=0), name="gw",
                       route_prefix="/gw")
    yield handle, port
    serve.shutdown()
    ray.shutdown()


def test_handles_and_http_answer_as_eager_and_errors_leave_the_replica_serving(served):
    handle, port = served
    model = make()
    for n in (1, 3, 7):
        x = torch.randn(n, 4)
        got = handle.infer.remote(x).result(timeout_s=60)
        torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
    # many requests at once through the handle: the replica's Batcher may join them
    xs = [torch.randn(1, 4) for _ in range(16)]
    responses = [handle.infer.remote(x) for x in xs]
    for x, r in zip(xs, responses):
        torch.testing.assert_close(r.result(timeout_s=60), model(x), rtol=1e-5, atol=1e-5)
    status, body = _post(port, {"inputs": [[0.1, 0.2, 0.3, 0.4], [1.0, 0.0, -1.0, 0.5]]})
    assert status == 200
    want = model(torch.tensor([[0.1, 0.2, 0.3, 0.4], [1.0, 0.0, -1.0, 0.5]])).tolist()
    torch.testing.assert_close(torch.tensor(body["outputs"]), torch.tensor(want), rtol=1e-5, atol=1e-5)
    # a request the model rejects: an error answer, and the replica goes on
    status, body = _post(port, {"inputs": [[float("nan")] * 4]})
    assert status == 400 and "NaN in the input" in body["error"]
    status, body = _post(port, {"nope": 1})
    assert status == 400 and "bad request" in body["error"]
    with pytest.raises(Exception, match="NaN in the input"):
        handle.infer.remote(torch.full((1, 4), float("nan"))).result(timeout_s=60)
    status, body = _post(port, {"inputs": [[0.0, 0.0, 0.0, 0.0]]})
    assert status == 200 and len(body["outputs"]) == 1
    stats = handle.stats.remote().result(timeout_s=60)
    assert stats["device"] == "cpu" and stats["batcher"]["requests"] == 3 + 16 + 4
