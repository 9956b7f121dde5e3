"""The OpenAI-compatible server as strangers call it, on a CPU: integers at their type's limits,
wrong types, huge bodies, clients that hang up while queued, an API key, every error in the
API's shape, and a shutdown whose drain ends before the streams do. Each bad request ends alone
with its 4xx and the reason; the others are served."""

import http.client
import json
import logging
import signal
import threading
import time

import pytest

pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
uvicorn = pytest.importorskip("uvicorn", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')

import tiny_lm  # noqa: E402
from helpers import free_port  # noqa: E402
from test_http_cpu import Running, _args, _Slow, _stream_begun, _wait, events, greedy, post  # noqa: E402

from graphwrap.serve.api import cli, make_app  # noqa: E402

INT64 = 2 ** 63 - 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_lm.make(str(tmp_path_factory.mktemp("tiny_lm")))


@pytest.fixture(scope="module")
def srv(model_dir):
    r = Running(cli.load(_args(model_dir, served_model_name="tiny", rows=4, max_queue=8)))
    yield r
    r.stop()


@pytest.fixture
def cpu_srv(model_dir):
    """A server whose batch runs on the CPU, wherever the tests run: the hook that slows its model
    (tests/test_http_cpu.py's _Slow) runs in every step there, and in no graph's replay."""
    r = Running(cli.load(_args(model_dir, served_model_name="tiny", rows=4, max_queue=8, device="cpu")))
    yield r
    r.stop()


def _request(port, method, path, body=None, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request(method, path, body, headers or {})
    r = c.getresponse()
    raw = r.read()
    c.close()
    return r.status, raw, {k.lower(): v for k, v in r.getheaders()}


def _openai_error(raw: bytes) -> dict:
    """The error of an answer, checked to be in the API's shape."""
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


def _still_serves(srv):
    status, body, _ = post(srv.port, "/v1/completions", {"prompt": "the", "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "x", "min_tokens": 2 ** 63}, "min_tokens", "less than or equal"),
    ({"prompt": "x", "top_k": 2 ** 63}, "top_k", "less than or equal"),
    ({"prompt": "x", "max_tokens": 2 ** 64}, "max_tokens", "less than or equal"),
    ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, None, "min_tokens (5) is more than max_tokens (2)"),
    ({"prompt": "x", "min_tokens": INT64}, None, "is more than max_tokens (16)"),
    ({"prompt": "x", "seed": 2 ** 64}, "seed", "less than or equal"),
    ({"prompt": "x", "stream": "yes"}, "stream", "valid boolean"),
    ({"prompt": "x", "n": "2"}, "n", "valid integer"),
    ({"prompt": "x", "max_tokens": 2.0}, "max_tokens", "valid integer"),
    ({"prompt": "x", "echo": 1}, "echo", "valid boolean"),
    ({"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids", "outside the model's vocabulary"),
    ({"prompt": "x", "stop_token_ids": [2 ** 63]}, "stop_token_ids", "less than or equal"),
    ({"prompt": [5, 2 ** 63], "max_tokens": 2}, "prompt", "less than or equal"),
    ({"prompt": [5, INT64], "max_tokens": 2}, "prompt", "outside the model's vocabulary"),
    ({"prompt": [-1, 5], "max_tokens": 2, "echo": True}, "prompt", "outside the model's vocabulary"),
    ({"prompt": "x", "stop": "a" * 2000}, None, "2000 characters"),
    ({"prompt": "x", "stop": ["a"] * 17}, None, "at most 16 stop strings"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty", "less than or equal"),
])
def test_fields_out_of_their_bounds_get_400_naming_them(srv, body, param, words):
    status, raw, _ = _request(srv.port, "POST", "/v1/completions", json.dumps(body),
                              {"Content-Type": "application/json"})
    assert status == 400, raw
    error = _openai_error(raw)
    assert words in error["message"] and error["type"] == "invalid_request_error", error
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    _still_serves(srv)


@pytest.mark.parametrize("raw", [b'{"prompt": "x", "repetition_penalty": Infinity}',
                                 b'{"prompt": "x", "temperature": NaN}',
                                 b'{"prompt": "x", "top_p": -Infinity}'])
def test_numbers_that_are_not_finite_get_400(srv, raw):
    status, answer, _ = _request(srv.port, "POST", "/v1/completions", raw, {"Content-Type": "application/json"})
    assert status == 400, answer
    assert "finite" in _openai_error(answer)["message"]


def test_integers_at_int64_s_limit_that_the_api_allows_are_served_beside_other_streams(srv):
    """top_k and min_tokens of 2**63 - 1 (with max_tokens at most that) are legal: served, and the
    stream beside them gets its tokens. (2**63 overflowed the batch's tables and ended every
    stream.)"""
    ids = srv.served.tokenizer("the quick")["input_ids"]
    results = {}

    def send(name, body):
        results[name] = events(srv.port, "/v1/completions", body)

    threads = [threading.Thread(target=send, args=("plain", {"prompt": ids, "max_tokens": 30, "temperature": 0})),
               threading.Thread(target=send, args=("top_k", {"prompt": [6] * 200, "max_tokens": 5, "top_k": INT64,
                                                             "seed": 2 ** 64 - 1})),
               threading.Thread(target=send, args=("min", {"prompt": [5] * 200, "max_tokens": 8,
                                                           "min_tokens": 8, "ignore_eos": False}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for name in ("plain", "top_k", "min"):
        status, evs = results[name]
        assert status == 200 and evs[-1] == "[DONE]", (name, evs[-3:])
    text = "".join(e["choices"][0]["text"] for e in results["plain"][1][:-1])
    assert text == greedy(srv, ids, 30)[1]
    assert srv.served.gm.stats()["decode"]["failed"] == 0


def test_a_chat_template_that_refuses_the_messages_gets_400(srv):
    tok = srv.served.tokenizer
    old = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system "
                         "messages') }}{% endif %}{{ m['content'] }}{% endfor %}")
    try:
        status, raw, _ = _request(srv.port, "POST", "/v1/chat/completions",
                                  json.dumps({"messages": [{"role": "system", "content": "hi"}]}),
                                  {"Content-Type": "application/json"})
        assert status == 400, raw
        error = _openai_error(raw)
        assert "chat template refused" in error["message"] and "no system messages" in error["message"]
        assert error["param"] == "messages"
    finally:
        tok.chat_template = old
    _still_serves(srv)


@pytest.mark.parametrize("method,path,body,headers,status,words", [
    ("GET", "/v1/nowhere", None, {}, 404, "no route /v1/nowhere"),
    ("GET", "/v1/completions", None, {}, 405, "GET is not allowed"),
    ("POST", "/v1/completions", b"\xff\xfe{", {"Content-Type": "application/json"}, 400, "not valid JSON"),
    ("POST", "/v1/completions", b"{not json", {"Content-Type": "application/json"}, 400, "not valid JSON"),
    ("POST", "/v1/completions", b'{"prompt": "x"}', {}, 400, "Content-Type"),
    ("POST", "/v1/completions", b'{"prompt": "x"}', {"Content-Type": "text/plain"}, 400, "Content-Type"),
    ("POST", "/v1/completions", b"[1, 2]", {"Content-Type": "application/json"}, 400, "body"),
])
def test_every_error_is_in_the_api_s_shape(srv, method, path, body, headers, status, words):
    got, raw, _ = _request(srv.port, method, path, body, headers)
    assert got == status, raw
    assert words in _openai_error(raw)["message"]


def test_head_of_metrics_answers_200(srv):
    status, raw, _ = _request(srv.port, "HEAD", "/metrics")
    assert status == 200 and raw == b""


def test_clients_that_hang_up_while_queued_give_up_their_place(cpu_srv):
    """Rows full of slowed requests, a queue of 8: streamed requests queued behind them whose
    clients hang up leave the queue at once (they filled --max-queue and were later prefilled for
    nobody), and live clients are then queued, not refused."""
    model = cpu_srv.served.gm.module
    slow = _Slow(model, 0.05)  # (200 tokens: 10 s a request)
    long = {"prompt": "the", "max_tokens": 200, "ignore_eos": True}
    conns = []
    try:
        busy = [threading.Thread(target=post, args=(cpu_srv.port, "/v1/completions", long)) for _ in range(4)]
        for t in busy:
            t.start()
        _wait(lambda: cpu_srv.served.gm.stats()["decode"]["rows_busy"] == 4, 30)
        d = cpu_srv.served.gm.stats()["decode"]
        cancelled, done = d["cancelled"], d["done"]
        for _ in range(8):  # the whole queue
            c = http.client.HTTPConnection("127.0.0.1", cpu_srv.port, timeout=30)
            c.request("POST", "/v1/completions", json.dumps(dict(long, stream=True)),
                      {"Content-Type": "application/json"})
            conns.append(c)
        _wait(lambda: cpu_srv.served.gm.stats()["decode"]["queued"] == 8, 30)
        for c in conns:  # hang up, still queued
            c.sock.close()
            c.close()
        # each gone at once (not once a row was free for it, seconds later), never prefilled
        _wait(lambda: cpu_srv.served.gm.stats()["decode"]["queued"] == 0, 3)
        _wait(lambda: cpu_srv.served.gm.stats()["decode"]["cancelled"] >= cancelled + 8, 3)
        d = cpu_srv.served.gm.stats()["decode"]
        assert d["rows_busy"] == 4 and d["done"] == done, "the running requests run on"
        status, body, _ = post(cpu_srv.port, "/v1/completions", {"prompt": "the", "max_tokens": 2}, timeout=120)
        assert status == 200, body
    finally:
        slow.remove()
        for t in busy:
            t.join(120)


@pytest.fixture
def limited(model_dir):
    served = cli.load(_args(model_dir, rows=2, max_body_mb=1.0, max_prompt_chars=20_000, api_key="sekrit"))
    r = Running(served)
    yield r
    r.stop()


def test_a_large_body_is_refused_413_before_it_is_read_and_health_answers_meanwhile(limited):
    key = {"Authorization": "Bearer sekrit", "Content-Type": "application/json"}
    big = json.dumps({"prompt": "word " * 400_000, "max_tokens": 2}).encode()  # 2 MB
    t0 = time.perf_counter()
    status, raw, headers = _request(limited.port, "POST", "/v1/completions", big, key)
    assert status == 413 and "too large" in _openai_error(raw)["message"]
    # without a Content-Length (chunked): refused once the bytes read pass the limit
    c = http.client.HTTPConnection("127.0.0.1", limited.port, timeout=30)
    c.request("POST", "/v1/completions", iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
              dict(key, **{"Transfer-Encoding": "chunked"}), encode_chunked=True)
    r = c.getresponse()
    assert r.status == 413 and "too large" in _openai_error(r.read())["message"]
    c.close()
    # under the body's limit, over the prompt's characters: 400 before any tokenizing
    status, raw, _ = _request(limited.port, "POST", "/v1/completions",
                              json.dumps({"prompt": "word " * 10_000, "max_tokens": 2}).encode(), key)
    assert status == 400 and "50000 characters" in _openai_error(raw)["message"]
    assert time.perf_counter() - t0 < 10
    status, _, _ = _request(limited.port, "GET", "/health")
    assert status == 200


def test_prompts_are_tokenized_off_the_event_loop(limited, monkeypatch):
    tok = limited.served.tokenizer
    seen = []
    real = type(tok).__call__

    def call(self, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(tok), "__call__", call)
    status, body, _ = _request(limited.port, "POST", "/v1/completions", json.dumps({"prompt": "the", "max_tokens": 2}),
                               {"Authorization": "Bearer sekrit", "Content-Type": "application/json"})
    assert status == 200
    assert seen and all(name.startswith("graphwrap-tokenize") for name in seen), seen


def test_an_api_key_is_asked_of_every_request_but_health_and_metrics(limited):
    body = json.dumps({"prompt": "the", "max_tokens": 2, "temperature": 0})
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"},
                    {"Authorization": "Basic sekrit"}):
        status, raw, got = _request(limited.port, "POST", "/v1/completions", body,
                                    dict(headers, **{"Content-Type": "application/json"}))
        assert status == 401 and got["www-authenticate"] == "Bearer", raw
        assert _openai_error(raw)["type"] == "authentication_error"
    status, raw, _ = _request(limited.port, "GET", "/v1/models")
    assert status == 401
    status, raw, _ = _request(limited.port, "POST", "/v1/completions", body,
                              {"Authorization": "Bearer sekrit", "Content-Type": "application/json"})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 2
    assert _request(limited.port, "GET", "/health")[0] == 200
    assert _request(limited.port, "GET", "/metrics")[0] == 200
    # the official client, with its api_key
    openai = pytest.importorskip("openai", reason="needs the openai client: pip install openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{limited.port}/v1", api_key="sekrit")
    got = client.completions.create(model=limited.served.name, prompt="the", max_tokens=3, temperature=0)
    assert got.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{limited.port}/v1", api_key="wrong").completions.create(
            model=limited.served.name, prompt="the", max_tokens=3)


def test_the_key_can_be_asked_on_health_and_metrics_too(model_dir):
    served = cli.load(_args(model_dir, rows=2, api_key="sekrit", api_key_everywhere=True))
    r = Running(served)
    try:
        assert _request(r.port, "GET", "/health")[0] == 401
        assert _request(r.port, "GET", "/metrics")[0] == 401
        assert _request(r.port, "GET", "/health", headers={"Authorization": "Bearer sekrit"})[0] == 200
    finally:
        r.stop()


@pytest.mark.parametrize("second_signal", [False, True], ids=["drain-ends", "second-signal"])
def test_streams_still_running_when_the_drain_ends_get_an_error_event_and_done(model_dir, caplog, second_signal):
    """Past --drain (or at a second signal), a stream is cut with an error event and [DONE] (its
    connection was dropped, and openai raised APIConnectionError), and the log says how many
    tokens it was sent (it said 0 after hundreds)."""
    served = cli.load(_args(model_dir, rows=2, device="cpu"))  # (slowed by a hook: see cpu_srv)
    app = make_app(served)
    port = free_port()
    drain = 60.0 if second_signal else 1.0
    server = cli.draining_server()(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"), served,
                                   drain)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait(lambda: server.started)
    slow = _Slow(served.gm.module, 0.02)
    caplog.set_level(logging.INFO, logger="graphwrap.serve")
    try:
        _, r = _stream_begun(port, {"prompt": "the", "max_tokens": 240, "ignore_eos": True})
        server.handle_exit(signal.SIGTERM, None)
        time.sleep(0.5)
        if second_signal:
            server.handle_exit(signal.SIGTERM, None)
        rest = r.read().decode()
        data = [line[6:] for line in rest.split("\n") if line.startswith("data: ")]
        assert data[-1] == "[DONE]", rest[-300:]
        error = json.loads(data[-2])["error"]
        assert "shutting down" in error["message"] and error["type"] == "service_unavailable"
        sent = sum(1 for d in data[:-2] if "choices" in json.loads(d))
        assert sent > 1
        thread.join(30)
        assert not thread.is_alive() and served.active == 0
    finally:
        slow.remove()
        server.should_exit = True
        thread.join(30)
        served.engine.close(cancel=True, timeout=30)
    cut = [rec.getMessage() for rec in caplog.records if " cut (" in rec.getMessage()]
    assert len(cut) == 1, [rec.getMessage() for rec in caplog.records]
    made = int(cut[0].split(" prompt tokens, ")[1].split(" generated")[0])
    assert made >= sent - 1 > 0, cut
