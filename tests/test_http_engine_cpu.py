"""The server with its decode batch in a child process (``--engine process``, the default of
``python -m graphwrap serve``), on a CPU: a tiny GPT-2 made on the spot, its forward slowed in
the child so that requests overlap. The answers are ``model.generate``'s; a client that goes
away, a full queue, a failing request and a dead child each end as the API says."""

import asyncio
import concurrent.futures
import http.client
import json
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
uvicorn = pytest.importorskip("uvicorn", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')

import tiny_lm  # noqa: E402
from helpers import free_port  # noqa: E402
from test_http_cpu import check_completion_logprobs, model_logprobs  # noqa: E402

from graphwrap.serve.api import Served, cli, engine_process, make_app  # noqa: E402
from graphwrap.serve.api.remote import Remote  # noqa: E402

STEP = 0.005  # seconds each forward of the child's model sleeps
BAD = "fox"  # a prompt holding this word's first token makes the child's model raise
# a request still running when the test acts on it: sampled, so without ignore_eos it may end early
LONG = {"prompt": "the", "max_tokens": 200, "ignore_eos": True}


def slowed(conn, args, log_level):
    """The child's entry: its model's every forward slowed by STEP, and a prompt's failing on
    BAD. Decode steps (a token a row) never fail: a step's padding rows hold whatever token their
    last sequence had, which may be BAD's."""
    real = tr.AutoModelForCausalLM.from_pretrained

    def load(*a, **k):
        model = real(*a, **k)
        bad = tr.AutoTokenizer.from_pretrained(args.model)(BAD)["input_ids"][0]

        def hook(module, a, kw):
            ids = kw.get("input_ids", a[0] if a else None)
            if ids is not None and ids.shape[-1] > 1 and bool((ids == bad).any()):
                raise RuntimeError("the model refuses this prompt")
            time.sleep(STEP)

        model.register_forward_pre_hook(hook, with_kwargs=True)
        return model

    tr.AutoModelForCausalLM.from_pretrained = load
    engine_process.run(conn, args, log_level)


class Running:
    """The app on a thread of this process, its batch in a child."""

    def __init__(self, model_dir, **options):
        a = cli.parser().parse_args([model_dir, "--served-model-name", "tiny"])
        for k, v in options.items():
            setattr(a, k, v)
        engine = Remote(a, "warning", entry=slowed)
        self.served = Served(engine, tr.AutoTokenizer.from_pretrained(model_dir), "tiny", engine.context)
        self.app, self.port = make_app(self.served), free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        _wait(lambda: self.server.started)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        return self.served.engine.close(cancel=True, timeout=30)


def _wait(cond, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_lm.make(str(tmp_path_factory.mktemp("tiny_lm")))


@pytest.fixture(scope="module")
def srv(model_dir):
    r = Running(model_dir, rows=2, max_queue=4)
    yield r
    assert r.stop() is True  # the child's batch closed in time, and the child exited
    assert r.served.engine.proc.exitcode == 0


def post(port, body, timeout=60):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = c.getresponse()
    out = r.status, json.loads(r.read()), {k.lower(): v for k, v in r.getheaders()}
    c.close()
    return out


def events(port, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)).encode(),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        return r.status, [json.loads(r.read())]
    out = [line[6:] for line in r.read().decode().split("\n") if line.startswith("data: ")]
    c.close()
    return r.status, [x if x == "[DONE]" else json.loads(x) for x in out]


def greedy_text(model_dir, prompt, n):
    tok = tr.AutoTokenizer.from_pretrained(model_dir)
    model = tr.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tok(prompt)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def _decode(srv):
    return srv.served.engine.stats()["decode"]


def test_answers_from_the_engine_process_are_generate_s_whole_and_streamed(srv, model_dir):
    text = greedy_text(model_dir, "the quick brown", 20)
    status, body, _ = post(srv.port, {"prompt": "the quick brown", "max_tokens": 20, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["text"] == text and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 20
    status, evs = events(srv.port, {"prompt": "the quick brown", "max_tokens": 20, "temperature": 0,
                                    "stream_options": {"include_usage": True}})
    assert status == 200 and evs[-1] == "[DONE]" and evs[-2]["usage"]["completion_tokens"] == 20
    assert "".join(e["choices"][0]["text"] for e in evs[:-2]) == text
    assert evs[-3]["choices"][0]["finish_reason"] == "length"
    # several at once share the child's batch, each its own answer
    out = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, post(srv.port, {
        "prompt": "the quick brown", "max_tokens": 20, "temperature": 0, "n": 2}))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(out[i][0] == 200 and [c["text"] for c in out[i][1]["choices"]] == [text, text] for i in range(2)), out


def test_log_probabilities_come_through_the_engine_process_beside_other_streams(srv, model_dir):
    tok = tr.AutoTokenizer.from_pretrained(model_dir)
    model = tr.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    want = model_logprobs(model, tok, tok("the quick brown")["input_ids"], 8, 2)
    body = {"prompt": "the quick brown", "max_tokens": 8, "temperature": 0, "logprobs": 2}
    out = {}
    plain = threading.Thread(target=lambda: out.__setitem__("plain", post(srv.port, dict(body, logprobs=None))))
    plain.start()  # (beside it in the child's batch: a sequence that asked for none)
    status, evs = events(srv.port, body)
    plain.join(60)
    assert status == 200 and evs[-1] == "[DONE]"
    parts = [e["choices"][0]["logprobs"] for e in evs[:-1] if e["choices"][0]["logprobs"]]
    check_completion_logprobs({k: [x for p in parts for x in p[k]] for k in parts[0]}, want, tok,
                              tok("the quick brown")["input_ids"], "".join(e["choices"][0]["text"] for e in evs[:-1]))
    assert out["plain"][0] == 200 and out["plain"][1]["choices"][0]["logprobs"] is None
    assert out["plain"][1]["choices"][0]["text"] == "".join(e["choices"][0]["text"] for e in evs[:-1])


def test_a_client_gone_frees_its_row_in_the_engine_process(srv):
    before = _decode(srv)["cancelled"]
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps(dict(LONG, stream=True)),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    r.readline()
    c.sock.close()  # 200 tokens at STEP each: a second of work left
    c.close()
    _wait(lambda: _decode(srv)["cancelled"] >= before + 1 and _decode(srv)["rows_busy"] == 0)
    assert srv.served.active == 0


def test_a_full_queue_429_a_bad_id_400_and_a_failing_request_500_each_alone(srv, model_dir):
    results = {}

    def send(name, body):
        results[name] = post(srv.port, body)

    # 2 rows and a queue of 4: 10 long requests at once, some must be refused
    threads = [threading.Thread(target=send, args=(i, {"prompt": "the", "max_tokens": 60, "temperature": 0}))
               for i in range(10)]
    threads.append(threading.Thread(target=send, args=("bad", {"prompt": BAD, "max_tokens": 5})))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    statuses = [results[i][0] for i in range(10)]
    assert statuses.count(429) >= 1 and statuses.count(200) >= 2, statuses
    assert all(results[i][2].get("retry-after") == "1" for i in range(10) if results[i][0] == 429)
    assert {results[i][1]["choices"][0]["text"] for i in range(10) if results[i][0] == 200} == \
        {greedy_text(model_dir, "the", 60)}
    status, body, _ = post(srv.port, {"prompt": BAD, "max_tokens": 5})
    assert status == 500 and "RuntimeError: the model refuses this prompt" in body["error"]["message"]
    status, body, _ = post(srv.port, {"prompt": [10**6], "max_tokens": 5})  # past the vocabulary: the child's check
    assert status == 400 and "vocab" in body["error"]["message"], body
    status, body, _ = post(srv.port, {"prompt": "the", "max_tokens": 3})
    assert status == 200
    _wait(lambda: _decode(srv)["rows_busy"] == 0 and _decode(srv)["queued"] == 0)


def test_a_client_that_reads_slowly_holds_up_no_one_else_and_gets_its_whole_text(srv, model_dir):
    want = greedy_text(model_dir, "the lazy", 100)
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"prompt": "the lazy", "max_tokens": 100, "temperature": 0,
                                                     "stream": True}), {"Content-Type": "application/json"})
    r = c.getresponse()  # (not read while the others run)
    other = greedy_text(model_dir, "a shared", 30)
    for _ in range(3):  # (answered while the slow reader's stream is not read)
        status, body, _ = post(srv.port, {"prompt": "a shared", "max_tokens": 30, "temperature": 0})
        assert status == 200 and body["choices"][0]["text"] == other
    time.sleep(0.5)
    evs = [json.loads(line[6:]) for line in r.read().decode().split("\n")
           if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in evs) == want
    c.close()


def test_metrics_and_health_read_the_engine_process(srv):
    post(srv.port, {"prompt": "the", "max_tokens": 3})
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["graphwrap_rows"] == 2 and values["graphwrap_decode_steps"] >= 2  # (3 tokens: a prefill, 2 steps)
    assert values["graphwrap_generation_tokens_total"] >= 3
    assert values["graphwrap_decode_turn_max_seconds"] >= STEP  # the child's turns, each a slowed forward at least
    assert "graphwrap_engine_gc_pause_max_seconds" in values
    assert 0 < values["graphwrap_token_delivery_p99_seconds"] < 5  # each token timed from its step to its feed
    stats = srv.served.engine.stats()
    assert stats["engine_frozen_objects"] > 10_000  # start-up's objects, out of the collector's sight
    d = stats["decode"]
    ms = [t["ms"] for t in d["slowest_turns"]]
    assert ms == sorted(ms, reverse=True) and ms[0] >= STEP * 1e3 and d["slowest_turns"][0]["step_ms"] >= 0
    c.request("GET", "/health")
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    c.close()


def test_the_engine_process_dying_ends_what_runs_and_refuses_the_rest(model_dir):
    r = Running(model_dir, rows=2)
    try:
        c = http.client.HTTPConnection("127.0.0.1", r.port, timeout=60)
        c.request("POST", "/v1/completions", json.dumps(dict(LONG, stream=True)),
                  {"Content-Type": "application/json"})
        resp = c.getresponse()
        assert resp.status == 200
        resp.readline()
        os.kill(r.served.engine.proc.pid, signal.SIGKILL)
        rest = [line[6:] for line in resp.read().decode().split("\n") if line.startswith("data: ")]
        assert rest[-1] == "[DONE]" and "engine process ended" in json.loads(rest[-2])["error"]["message"]
        status, body, headers = post(r.port, {"prompt": "the", "max_tokens": 3})
        assert status == 503 and "engine process ended" in body["error"]["message"]
        h = http.client.HTTPConnection("127.0.0.1", r.port, timeout=10)
        h.request("GET", "/health")
        resp = h.getresponse()
        assert resp.status == 503 and json.loads(resp.read())["status"] == "failed"
        assert r.served.active == 0
    finally:
        assert r.stop() is False  # (nothing left to close)


def test_the_engine_s_side_cancels_a_sequence_whether_or_not_it_was_queued_yet(model_dir):
    """The child's Worker over a pipe in this process: a cancel that comes right behind its
    submit (before or after the call is queued) ends the sequence as cancelled, frees its row,
    and leaves nothing pending."""
    from graphwrap import GraphedModule

    model = tr.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    hook = model.register_forward_pre_hook(lambda m, a: time.sleep(STEP))
    gm = GraphedModule(model, decode={"rows": 2})
    ours, theirs = multiprocessing.Pipe()
    worker = engine_process.Worker(theirs, gm)
    thread = threading.Thread(target=worker.serve, daemon=True)
    thread.start()
    try:
        kw = {"max_new_tokens": 100, "do_sample": False, "pad_token_id": 0}
        for rid in range(4):
            ours.send(("submit", rid, [5, 6, 7], kw, None))
            ours.send(("cancel", rid))
        ours.send(("submit", 9, [5, 6, 7], dict(kw, max_new_tokens=4), None))
        got, ends = [], {}
        while len(ends) < 5:
            for item in ours.recv():
                got.append(item)
                if item[0] == "e":
                    ends[item[1]] = item
        assert all(ends[rid][4][0] == "cancelled" for rid in range(4)), ends
        assert ends[9][2:] == (4, ends[9][3], None)
        tokens = [t for i in got if i[0] == "T" for r, t in zip(i[1], i[2]) if r == 9]
        assert len(tokens) == 4 and tokens[-1] == ends[9][3], got  # a turn's tokens in one item (the batch's sink)
        assert not [i for i in got if i[0] == "t" and i[1] == 9]
        assert got.index(ends[9]) > max(k for k, i in enumerate(got) if i[0] == "T"), "its end after its tokens"
        ours.send(("stats", 100))
        (stats,) = [i for i in ours.recv() if i[0] == "s"]
        assert stats[2]["decode"]["rows_busy"] == 0 and stats[2]["decode"]["cancelled"] >= 4
        assert not worker.calls and not worker.pending and not worker.cancelled
    finally:
        ours.send(("close", True, 30))
        thread.join(30)
        hook.remove()


class _Ends:
    def __init__(self):
        self.tokens, self.ended = [], 0

    def add(self, tokens):
        self.tokens += tokens

    def end(self):
        self.ended += 1


def _remote_without_a_child():
    """A Remote's receiving side with no process behind it (what the child sends is fed to
    ``_take`` by hand; what it would send goes to ``sent``)."""
    r = Remote.__new__(Remote)
    r.lock, r.send_lock, r.join_lock = threading.Lock(), threading.Lock(), threading.Lock()
    r.seqs, r.asks, r.dead, r.closing = {}, {}, None, False
    r.ids = iter(range(1000))
    r.closed = concurrent.futures.Future()
    r.sent = []
    r._send = r.sent.append
    r._join = lambda timeout: -9
    return r


def test_the_http_side_takes_the_child_s_words_in_any_order_and_a_dead_child_ends_everything():
    from graphwrap.decoding.callers.errors import QueueFull
    from graphwrap.serve.api.engines import Ended, EngineGone, Failed

    r = _remote_without_a_child()

    async def queue(feed):
        return await r.queue([1, 2], {}, None, feed)

    async def scenario():
        # an end that comes before the word that the sequence was queued: both settle
        a = _Ends()
        task = asyncio.ensure_future(queue(a))
        await asyncio.sleep(0)
        rid = r.sent[-1][1]
        r._take(("t", rid, [5, 6]))
        r._take(("e", rid, 2, 6, None))
        r._take(("q", rid, None))
        result = await asyncio.wait_for(task, 5)
        assert result.result(1) == Ended(2, 6) and a.tokens == [5, 6] and a.ended == 1 and rid not in r.seqs
        # refused at queueing: the request's error, nothing left behind
        task = asyncio.ensure_future(queue(_Ends()))
        await asyncio.sleep(0)
        r._take(("q", r.sent[-1][1], ("queue_full", "the queue is full")))
        with pytest.raises(QueueFull, match="the queue is full"):
            await task
        # a call that failed there: its error by name; a cancel here is sent there once
        task = asyncio.ensure_future(queue(_Ends()))
        await asyncio.sleep(0)
        rid = r.sent[-1][1]
        r._take(("q", rid, None))
        failing = await task
        r._take(("e", rid, 0, -1, ("RuntimeError", "boom")))
        with pytest.raises(Failed, match="boom"):
            failing.result(1)
        task = asyncio.ensure_future(queue(_Ends()))
        await asyncio.sleep(0)
        rid = r.sent[-1][1]
        r._take(("q", rid, None))
        cancelled = await task
        assert cancelled.cancel() and r.sent[-1] == ("cancel", rid)
        cancelled.cancel()
        assert r.sent.count(("cancel", rid)) == 1
        r._take(("t", rid, [9]))  # (tokens still on their way are dropped)
        # the child dies: what is in flight ends with why, and new sequences are refused
        running = _Ends()
        task = asyncio.ensure_future(queue(running))
        await asyncio.sleep(0)
        r._take(("q", r.sent[-1][1], None))
        live = await task
        r._died()
        assert running.ended == 1 and isinstance(live.exception(1), EngineGone)
        assert "exit code -9" in r.gone() and r.stats() == {}
        with pytest.raises(EngineGone):
            await queue(_Ends())
        assert not r.seqs
        # a pipe that broke before the receiving thread saw the child die: the send fails, the
        # sequence is not left behind, and a cancel of one in flight does not raise
        r.dead = None

        def broken(msg):
            raise EngineGone("the engine process is gone")

        task = asyncio.ensure_future(queue(_Ends()))
        await asyncio.sleep(0)
        r._take(("q", r.sent[-1][1], None))
        held = await task
        r._send = broken
        with pytest.raises(EngineGone):
            await queue(_Ends())
        assert held.cancel() and not r.seqs

    asyncio.run(scenario())


class _SlowEngine:
    """A stand-in for the engine process: ready after ``seconds`` (or failing then)."""

    def __init__(self, seconds, fail=False):
        self.started, self.closed, self.context = time.perf_counter(), [], 64
        time.sleep(seconds)
        if fail:
            raise RuntimeError("the engine process failed to load the model")

    def close(self, cancel=True, timeout=None):
        self.closed.append(cancel)
        return True


def test_the_http_process_loads_its_tokenizer_while_the_engine_process_loads(monkeypatch, model_dir):
    """transformers' import and the tokenizer's load run beside the engine's start, not after
    its ready: the two together take about the longer of them."""
    from graphwrap.serve.api import loading, remote

    a = cli.parser().parse_args([model_dir])
    made = {}

    def tokenizer(args):
        made["tokenizer_started"] = time.perf_counter()
        time.sleep(0.5)
        return tr.AutoTokenizer.from_pretrained(args.model)

    def engine(args, log_level):
        made["engine"] = e = _SlowEngine(0.5)
        return e

    monkeypatch.setattr(loading, "tokenizer_of", tokenizer)
    monkeypatch.setattr(remote, "Remote", engine)
    t0 = time.perf_counter()
    served = cli.load(a, "process")
    took = time.perf_counter() - t0
    assert served.engine is made["engine"] and served.tokenizer("the")["input_ids"]
    assert made["tokenizer_started"] - t0 < 0.3, "the tokenizer waited for the engine"
    assert took < 0.95, took  # (one after the other: 1.0 s and more)


def test_a_tokenizer_that_fails_closes_the_engine_process_and_says_why(monkeypatch, model_dir):
    from graphwrap.serve.api import loading, remote

    a = cli.parser().parse_args([model_dir])
    made = {}

    def tokenizer(args):
        raise OSError("no tokenizer files in the folder")

    def engine(args, log_level):
        made["engine"] = e = _SlowEngine(0.05)
        return e

    monkeypatch.setattr(loading, "tokenizer_of", tokenizer)
    monkeypatch.setattr(remote, "Remote", engine)
    with pytest.raises(OSError, match="no tokenizer files"):
        cli.load(a, "process")
    assert made["engine"].closed == [True]


def test_an_engine_that_fails_to_start_is_the_error_raised(monkeypatch, model_dir):
    from graphwrap.serve.api import loading, remote

    a = cli.parser().parse_args([model_dir])
    monkeypatch.setattr(loading, "tokenizer_of", lambda args: tr.AutoTokenizer.from_pretrained(args.model))
    monkeypatch.setattr(remote, "Remote", lambda args, log_level: _SlowEngine(0.05, fail=True))
    with pytest.raises(RuntimeError, match="failed to load the model"):
        cli.load(a, "process")
