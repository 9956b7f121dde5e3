"""graphwrap.serve on a GPU: a replica captures every bucket when it starts, then its answers over
HTTP and through a handle equal eager for named text inputs of several lengths; bad requests get
their 4xx, and the replica keeps serving. Needs Ray Serve and transformers."""


import pytest
import torch

pytestmark = pytest.mark.cuda
ray = pytest.importorskip("ray", reason='needs Ray Serve: pip install -e ".[serve]" in a checkout')
serve = pytest.importorskip("ray.serve")
pytest.importorskip("transformers", reason="needs transformers, which no extra installs: pip install transformers")

import os  # noqa: E402

from helpers import free_port, post_json  # noqa: E402
from serve_models import bert_mean_pool, make_small_bert  # noqa: E402

import graphwrap.serve  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = [16, 32, 64, 128]


def _post(port, body):
    return post_json(port, body, "bert")


@pytest.fixture(scope="module")
def served():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    ids = torch.randint(1, 1000, (2, 20))
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    handle = serve.run(graphwrap.serve.deployment(
        make_small_bert, name="bert", sample=sample, num_gpus=1, postprocess=bert_mean_pool,
        graphed={"seq_dim": 1, "max_batch_size": 8, "seq_buckets": SEQ}), name="bert", route_prefix="/bert")
    yield handle, port
    serve.shutdown()
    ray.shutdown()


def test_a_replica_on_a_gpu_answers_as_eager_over_http_and_handles(served):
    handle, port = served
    s = handle.stats.remote().result(timeout_s=120)
    assert s["device"] == "cuda" and s["batcher"]["requests"] == 0
    buckets = s["graphs"]["keys"][0]["buckets"]
    assert len(buckets) >= 12 and all(b["captured"] for b in buckets.values()), buckets
    model = make_small_bert().cuda()
    g = torch.Generator().manual_seed(1)
    for n, L in ((1, 3), (2, 17), (5, 40), (8, 100), (3, 128)):
        ids = torch.randint(1, model.config.vocab_size, (n, L), generator=g)
        mask = torch.ones_like(ids)
        mask[0, L - L // 3:] = 0
        with torch.no_grad():
            enc = {"input_ids": ids.cuda(), "attention_mask": mask.cuda()}
            want = bert_mean_pool(model(**enc), enc).cpu()
        status, body = _post(port, {"inputs": {"input_ids": ids.tolist(), "attention_mask": mask.tolist()}})
        assert status == 200, body
        torch.testing.assert_close(torch.tensor(body["outputs"]), want, rtol=2e-3, atol=2e-3)
        got = handle.infer.remote(input_ids=ids, attention_mask=mask).result(timeout_s=120)
        assert got.device.type == "cpu"
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    # many at once through the handle: joined by the replica's Batcher, each its own answer
    reqs = [torch.randint(1, 1000, (1 + i % 4, 5 + 7 * i)) for i in range(12)]
    responses = [handle.infer.remote(input_ids=r, attention_mask=torch.ones_like(r)) for r in reqs]
    for r, resp in zip(reqs, responses):
        with torch.no_grad():
            enc = {"input_ids": r.cuda(), "attention_mask": torch.ones_like(r).cuda()}
            want = bert_mean_pool(model(**enc), enc).cpu()
        torch.testing.assert_close(resp.result(timeout_s=120), want, rtol=2e-3, atol=2e-3)
    assert handle.stats.remote().result(timeout_s=120)["graphs"]["eager_calls"] == {}
    # bad requests: each its status and message, and the replica goes on
    status, body = _post(port, {"inputs": {"input_ids": [[1, 2, 30522]], "attention_mask": [[1, 1, 1]]}})
    assert status == 422 and "outside [0, 30522)" in body["error"]
    status, body = _post(port, {"inputs": {"input_ids": [[1, 2]], "attention_mask": [[1, 1, 1]]}})
    assert status == 422, body
    status, body = _post(port, {"inputs": {"input_ids": [[1, 2], [3]]}})
    assert status == 400 and "rectangular" in body["error"]
    status, body = _post(port, b"not json")
    assert status == 400
    status, body = _post(port, {"inputs": {"input_ids": [[1] * 5000], "attention_mask": [[1] * 5000]}})
    assert status == 413 and "max_length" in body["error"]
    status, body = _post(port, {"inputs": {"input_ids": [[5, 6, 7]], "attention_mask": [[1, 1, 1]]}})
    assert status == 200 and len(body["outputs"]) == 1
    s = handle.stats.remote().result(timeout_s=120)
    assert s["http_status"] == {200: 6, 400: 2, 413: 1, 422: 2}
    assert len(s["graphs"]["keys"]) == 1, "requests arrive on the host: the graphs captured at start serve them"
    assert sum(b["graphs"] for b in s["graphs"]["keys"][0]["buckets"].values()) == len(buckets)
    print(f"\nreplica: {s['batcher']['requests']} requests, {s['batcher']['module_calls']} module calls, "
          f"http {s['http_status']}, eager calls {s['graphs']['eager_calls']}")
