"""``python -m graphwrap serve`` as a user runs it (a process of its own, the batch in its child),
driven by the official ``openai`` client, and ``curl`` for ``/metrics`` and ``/health``: the
answers are ``model.generate``'s, streamed with usage, cut at stop strings, ``n`` and seeds as
the API has them, log-probabilities the model's; a stream closed by the client frees its row; a
full queue is ``RateLimitError`` (429); a bad request ``BadRequestError`` (400)."""

import json
import subprocess
import threading
import time

import pytest
import torch

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
openai = pytest.importorskip("openai", reason='needs the openai client: pip install -e ".[test]"')

import tiny_lm  # noqa: E402
from helpers import serve_cli  # noqa: E402
from test_http_cpu import model_logprobs  # noqa: E402


def curl(url):
    """``curl -s URL``: its status and body (curl is what the README tells users to call it with)."""
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", url], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    body, status = out.rsplit("\n", 1)
    return int(status), body


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = tiny_lm.make(str(tmp_path_factory.mktemp("tiny_lm_openai")))
    p, port = serve_cli(model_dir, "--served-model-name", "tiny", "--rows", "2", "--max-queue", "2")
    try:
        tok = tr.AutoTokenizer.from_pretrained(model_dir)
        model = tr.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        yield port, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0), tok, model
    finally:
        p.terminate()
        p.wait(60)


def greedy(model, tok, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def test_completions_chat_streams_stops_n_and_seeds_through_the_openai_client(served):
    port, client, tok, model = served
    want = greedy(model, tok, tok("the quick brown")["input_ids"], 12)
    r = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=12, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="tiny", prompt="the quick brown", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    # a stop string: the text up to it, without it
    stop = want[len(want) // 2:len(want) // 2 + 3]
    r = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == want[:want.index(stop)] and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=12, temperature=0, n=2)
    assert [c.text for c in r.choices] == [want, want] and [c.index for c in r.choices] == [0, 1]
    seeded = [client.completions.create(model="tiny", prompt="the quick brown", max_tokens=12, temperature=1.0,
                                        seed=7).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    # chat: the tokenizer's template, then generate's tokens
    messages = [{"role": "user", "content": "the lazy dog"}]
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == greedy(model, tok, ids, 8) and r.choices[0].message.role == "assistant"


def test_log_probabilities_through_the_openai_client_are_the_model_s(served):
    port, client, tok, model = served
    want = model_logprobs(model, tok, tok("the quick brown")["input_ids"], 6, 2)
    r = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    if "\ufffd" not in r.choices[0].text:  # (each token named by the text it adds; bytes never completed: in none)
        assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(abs(a - b) < 1e-4 for a, (_, b, _) in zip(lp.token_logprobs, want, strict=True))
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob and c.logprob <= 0 for c in content)


def test_a_closed_stream_frees_its_row_a_full_queue_is_429_and_bad_requests_400(served):
    port, client, tok, model = served
    stream = client.completions.create(model="tiny", prompt="the", max_tokens=200, temperature=0, stream=True)
    next(iter(stream))
    stream.close()  # the client goes away mid-stream

    def metric(name):
        _, text = curl(f"http://127.0.0.1:{port}/metrics")
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))

    deadline = time.monotonic() + 30
    while metric("graphwrap_sequences_running") != 0:
        assert time.monotonic() < deadline, "the closed stream's row was not freed"
        time.sleep(0.1)
    # 2 rows and a queue of 2: twelve long requests at once, some answered 429
    got = {}

    def ask(i):
        try:
            got[i] = client.completions.create(model="tiny", prompt="the", max_tokens=200, temperature=0).usage
        except openai.RateLimitError as e:
            got[i] = e

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    refused = [g for g in got.values() if isinstance(g, openai.RateLimitError)]
    assert len(got) == 12 and refused and len(refused) <= 10, got
    assert all(e.status_code == 429 and e.response.headers.get("retry-after") == "1" for e in refused)
    for kwargs, words in [({"logprobs": 2, "echo": True}, "logprobs with echo"),
                          ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
                          ({"max_tokens": 10_000}, "context")]:
        with pytest.raises(openai.BadRequestError, match=words):
            client.completions.create(model="tiny", prompt="the", **{"max_tokens": 4, **kwargs})
    status, body = curl(f"http://127.0.0.1:{port}/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    assert metric('graphwrap_requests_total{endpoint="/v1/completions",status="429"}') == len(refused)
