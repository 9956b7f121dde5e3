"""graphwrap.serve on a local Ray instance (the CPU: eager calls): HTTP and handles, errors, recovery.

Ray is a dependency of this test only (CI installs it: pip install -e ".[serve]" in a checkout)."""


import pytest
import torch

ray = pytest.importorskip("ray", reason='needs Ray Serve: pip install -e ".[serve]" in a checkout')
serve = pytest.importorskip("ray.serve")

from helpers import post_json, ray_serving  # noqa: E402
from serve_models import make, make_embedder, mean_pool, tokenize  # noqa: E402

import graphwrap.serve  # noqa: E402


def _post(port, body, route="gw"):
    return post_json(port, body, route)


@pytest.fixture(scope="module")
def served():
    port = ray_serving()
    handle = serve.run(graphwrap.serve.deployment(make, sample=torch.randn(1, 4), num_gpus=0,
                                                  limits={"max_rows": 32}), name="gw", route_prefix="/gw")
    text = serve.run(graphwrap.serve.deployment(make_embedder, name="text", num_gpus=0, graphed={"seq_dim": 1},
                                                preprocess=tokenize, postprocess=mean_pool),
                     name="text", route_prefix="/text")
    yield handle, port, text
    serve.delete("gw")
    serve.delete("text")


def test_handles_and_http_answer_as_eager_and_errors_leave_the_replica_serving(served):
    handle, port, _ = served
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
    status, body = _post(port, {"inputs": [[float("nan")] * 4]})  # a number JSON has not: refused at the door
    assert status == 400 and "holds NaN or infinite numbers" in body["error"]
    status, body = _post(port, {"inputs": [[0.0] * 5]})  # a wrong width: the client's error
    assert status == 422 and "shapes cannot be multiplied" in body["error"]
    status, body = _post(port, {"nope": 1})
    assert status == 400 and 'no "inputs"' in body["error"]
    status, body = _post(port, {"inputs": [[0.0] * 4], "dtype": "__class__"})
    assert status == 400 and "is not one of" in body["error"]
    status, body = _post(port, {"inputs": [[0.0] * 4] * 33})
    assert status == 413 and "max_rows=32" in body["error"]
    with pytest.raises(Exception, match="NaN in the input"):
        handle.infer.remote(torch.full((1, 4), float("nan"))).result(timeout_s=60)
    status, body = _post(port, {"inputs": [[0.0, 0.0, 0.0, 0.0]]})
    assert status == 200 and len(body["outputs"]) == 1
    stats = handle.stats.remote().result(timeout_s=60)
    assert stats["device"] == "cpu" and stats["batcher"]["requests"] == 3 + 16 + 4
    assert stats["http_status"] == {200: 2, 400: 3, 413: 1, 422: 1}
    assert "graphwrap_requests" in stats["metrics"] and "graphwrap_queue_wait_ms_p99" in stats["metrics"]


def test_text_over_http_with_preprocess_and_postprocess(served):
    _, port, text = served
    model = make_embedder()
    texts = ["graphs", "of every length", "ok"]
    status, body = _post(port, {"texts": texts}, route="text")
    assert status == 200, body
    enc = tokenize({"texts": texts})
    torch.testing.assert_close(torch.tensor(body["outputs"]), mean_pool(model(**enc), enc).detach(),
                               rtol=1e-5, atol=1e-5)
    status, body = _post(port, {"inputs": []}, route="text")
    assert status == 400 and body["error"].startswith("preprocess: KeyError")
    got = text.infer.remote(**enc).result(timeout_s=60)  # a handle: tensors in, postprocess applied
    torch.testing.assert_close(got, mean_pool(model(**enc), enc).detach(), rtol=1e-5, atol=1e-5)
