"""The OpenAI-compatible app as a Ray Serve deployment on a local Ray instance (the CPU): a
replica loads the model and serves completions, streamed and whole, through Ray's HTTP proxy;
a bad request gets its status and the replica goes on."""

import http.client
import json

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
pytest.importorskip("fastapi", reason='needs FastAPI: pip install -e ".[serve]"')
ray = pytest.importorskip("ray", reason='needs Ray Serve: pip install -e ".[serve]"')
serve = pytest.importorskip("ray.serve")

import tiny_lm  # noqa: E402
from helpers import ray_generation  # noqa: E402
from test_http_cpu import events, greedy_text, post  # noqa: E402

import graphwrap  # noqa: E402
import graphwrap.serve  # noqa: E402


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    model_dir = tiny_lm.make(str(tmp_path_factory.mktemp("tiny_lm_ray")))
    for port in ray_generation(model_dir, "gen", args=["--served-model-name", "tiny"]):
        yield model_dir, port


def test_a_replica_serves_the_openai_api_through_ray_s_proxy(deployed):
    model_dir, port = deployed
    want = greedy_text(model_dir, "the quick brown", 12)
    status, body, _ = post(port, "/v1/completions", {"model": "tiny", "prompt": "the quick brown", "max_tokens": 12,
                                                     "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["text"] == want and body["usage"]["completion_tokens"] == 12
    status, evs = events(port, "/v1/completions", {"prompt": "the quick brown", "max_tokens": 12, "temperature": 0,
                                                   "stream_options": {"include_usage": True}})
    assert status == 200 and evs[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in evs[:-2]) == want
    status, body, _ = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 2, "suffix": "y"})
    assert status == 400 and "suffix" in json.dumps(body)
    status, body, _ = post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] <= 3
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    gpu = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("graphwrap_gpu_memory_allocated")]
    if torch.cuda.is_available():  # (the replica asked Ray for a GPU, and its batch lives there)
        assert gpu and gpu[0] > 0, text
    else:
        assert not gpu


def test_options_the_server_does_not_take_are_refused_before_any_replica_starts():
    with pytest.raises(graphwrap.GraphwrapError, match="--rowz"):
        graphwrap.serve.generation_deployment("some-model", args=["--rowz", "8"])
