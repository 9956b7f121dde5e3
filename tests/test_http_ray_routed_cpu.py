"""The OpenAI app on Ray Serve with two engine replicas routed by prompt (``generation_deployment(
..., num_replicas=2)``), on a local Ray instance (the CPU): the ingress tokenizes and streams each
sequence from an engine replica; prompts that start alike go to one replica; every answer is
greedy generate's, streamed or whole; a bad request gets its 400."""

import concurrent.futures
import http.client

import pytest

pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
pytest.importorskip("fastapi", reason='needs FastAPI: pip install -e ".[serve]"')
ray = pytest.importorskip("ray", reason='needs Ray Serve: pip install -e ".[serve]"')
serve = pytest.importorskip("ray.serve")
pytest.importorskip("ray.serve.request_router", reason="prefix routing on Ray needs Ray 2.46 or later")

import tiny_lm  # noqa: E402
from helpers import ray_generation  # noqa: E402
from test_http_cpu import events, post  # noqa: E402


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    model_dir = tiny_lm.make(str(tmp_path_factory.mktemp("tiny_lm_ray_routed")))
    for port in ray_generation(model_dir, "gen2", args=["--served-model-name", "tiny"], num_replicas=2):
        yield model_dir, port


def _greedy(model_dir, ids, n):
    import torch
    import transformers as tr

    model = tr.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return tr.AutoTokenizer.from_pretrained(model_dir).decode(out[0, len(ids):])


def _sent(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    return sorted(float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("graphwrap_engine_sequences_total{"))


def test_prompts_that_start_alike_go_to_one_engine_replica_and_every_answer_is_greedy(deployed):
    model_dir, port = deployed
    system = [(7 * i) % 300 + 5 for i in range(48)]
    for i in range(4):  # (one after another: each after the first goes where the first went)
        ids = system + [10 + i, 11 + i]
        status, body, _ = post(port, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 6,
                                                         "temperature": 0, "ignore_eos": True})
        assert status == 200 and body["choices"][0]["text"] == _greedy(model_dir, ids, 6), body
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == (48 if i else 0), body["usage"]
    assert _sent(port) == [4.0], "every one on the replica that had the system prompt"
    others = [[(13 * i + 3 * j) % 300 + 5 for j in range(20)] for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda ids: events(port, "/v1/completions", {"prompt": ids, "max_tokens": 6,
                                                                         "temperature": 0, "ignore_eos": True}),
                            others))
    for ids, (status, evs) in zip(others, got):
        assert status == 200 and evs[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in evs[:-1]) == _greedy(model_dir, ids, 6)
    assert sum(_sent(port)) == 12
    status, body, _ = post(port, "/v1/completions", {"prompt": [5, 10 ** 6], "max_tokens": 2})
    assert status == 400 and "vocabulary" in body["error"]["message"], body
