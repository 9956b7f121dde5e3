"""The OpenAI-compatible server (``python -m graphwrap serve``) over HTTP on a CPU: a tiny GPT-2 and
tokenizer made on the spot (tests/tiny_lm.py), the app served by uvicorn in a thread, requests
sent with the standard library. Its answers are ``model.generate``'s tokens, decoded; every bad
request ends alone with its status; a client that goes away frees its row."""

import argparse
import http.client
import json
import signal
import threading
import time

import pytest
import torch

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
uvicorn = pytest.importorskip("uvicorn", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')

import tiny_lm  # noqa: E402
from helpers import free_port, serve_cli  # noqa: E402

from graphwrap.serve.api import cli, make_app  # noqa: E402


def _args(path, **kw):
    """``python -m graphwrap serve PATH``'s arguments, the batch in this process (its tests reach
    into it; tests/test_http_engine_cpu.py serves from the child process)."""
    a = cli.parser().parse_args([path, "--engine", "thread"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


class Running:
    """An app served by uvicorn on a thread of this process."""

    def __init__(self, served):
        self.served, self.app, self.port = served, make_app(served), free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.served.engine.close(cancel=True, timeout=30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_lm.make(str(tmp_path_factory.mktemp("tiny_lm")))


@pytest.fixture(scope="module")
def srv(model_dir):
    r = Running(cli.load(_args(model_dir, served_model_name="tiny", rows=4, max_queue=4)))
    yield r
    r.stop()


def post(port, path, body, timeout=60):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    c.request("POST", path, data, {"Content-Type": "application/json"})
    r = c.getresponse()
    out = r.status, json.loads(r.read()), {k.lower(): v for k, v in r.getheaders()}
    c.close()
    return out


def events(port, path, body, timeout=60):
    """A streamed answer: (status, the data of each event, JSON decoded, "[DONE]" as is)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, json.dumps(dict(body, stream=True)).encode(), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        return r.status, [json.loads(r.read())]
    out = []
    for line in r.read().decode().split("\n"):
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    c.close()
    return r.status, out


def _stream_begun(port, body):
    """A streamed completion whose answer is 200 and whose first event was read: (connection, response)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    r.readline()
    return c, r


def greedy(srv, ids, n):
    """``model.generate``'s new tokens for ``ids`` and the text they decode to."""
    m, tok = srv.served.gm.module, srv.served.tokenizer
    out = m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    new = out[0, len(ids):].tolist()
    return new, tok.decode(new, skip_special_tokens=True)


def model_logprobs(model, tok, ids, n, k):
    """``model.generate``'s greedy tokens for ``ids``, each with its log-probability and its step's
    ``k`` most likely ``(id, log-probability)``, from the model's own logits."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
    got = []
    for t, x in zip(out.sequences[0, len(ids):].tolist(), out.logits):
        lp = torch.log_softmax(x[0].float(), -1)
        top = lp.topk(k)
        got.append((t, lp[t].item(), list(zip(top.indices.tolist(), top.values.tolist()))))
    return got


def check_completion_logprobs(lp, want, tok, ids, text=None):
    """Completions' ``logprobs`` against :func:`model_logprobs` for the prompt ``ids``: each
    token named by the text it adds to the choice's text (the tokens before it decoded with it and
    without), each of its step's most likely by the text it would have added in its place, the
    log-probabilities, the offsets; and, given the choice's ``text``, the tokens' texts make it up."""
    def added(prefix, t):
        before = tok.decode(prefix, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return tok.decode(prefix + [t], skip_special_tokens=True, clean_up_tokenization_spaces=False)[len(before):]

    gen = [t for t, _, _ in want]
    names = [added(list(ids) + gen[:i], t) for i, t in enumerate(gen)]
    # A token that ends inside a character adds nothing yet: its bytes come out with a later token
    # (or, never completed, at the end, in no token). Named exactly: a whole token after a whole one.
    ends = [not n.endswith("\ufffd") for n in names]
    whole = [e and (i == 0 or ends[i - 1]) for i, e in enumerate(ends)]
    assert len(lp["tokens"]) == len(want)
    assert all(got == n for got, n, w in zip(lp["tokens"], names, whole) if w), (lp["tokens"], names)
    assert all(abs(a - b) < 1e-4 for a, (_, b, _) in zip(lp["token_logprobs"], want, strict=True))
    for i, (top, (t, v, best)) in enumerate(zip(lp["top_logprobs"], want, strict=True)):
        prefix = list(ids) + gen[:i]
        expect = {added(prefix, j): x for j, x in best}
        expect.setdefault(lp["tokens"][i], v)
        if whole[i] and all(not k.endswith("\ufffd") for k in expect):
            assert top.keys() == expect.keys() and all(abs(top[w] - expect[w]) < 1e-4 for w in top), (top, expect)
    assert lp["text_offset"] == [sum(len(x) for x in lp["tokens"][:i]) for i in range(len(want))]
    if text is not None and "\ufffd" not in text:  # (bytes never completed: in the text, in no token)
        assert "".join(lp["tokens"]) == text


def greedy_text(model_dir, prompt, n):
    """``model.generate``'s text for ``prompt``, the model and tokenizer loaded from ``model_dir``."""
    tok = tr.AutoTokenizer.from_pretrained(model_dir)
    model = tr.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tok(prompt)["input_ids"]
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def _wait(cond, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _ended(srv):
    d = _decode_stats(srv)
    return d["cancelled"] + d["done"]


def _decode_stats(srv):
    return srv.served.gm.stats()["decode"]


def test_completions_give_generate_s_tokens_decoded_whole_and_streamed(srv):
    tok = srv.served.tokenizer
    ids = tok("the quick brown")["input_ids"]
    new, text = greedy(srv, ids, 12)
    status, body, _ = post(srv.port, "/v1/completions", {"model": "tiny", "prompt": "the quick brown",
                                                          "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["text"] == text
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # the same as token ids, streamed, with the usage asked for
    status, evs = events(srv.port, "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0,
                                                       "stream_options": {"include_usage": True}})
    assert status == 200 and evs[-1] == "[DONE]"
    chunks = evs[:-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["usage"] is None for c in chunks)
    assert evs[-2]["choices"] == [] and evs[-2]["usage"]["completion_tokens"] == 12
    # echo: the prompt first
    status, body, _ = post(srv.port, "/v1/completions", {"prompt": "the quick brown", "max_tokens": 12,
                                                          "temperature": 0, "echo": True})
    assert body["choices"][0]["text"] == "the quick brown" + text


def test_the_batch_in_this_process_hands_each_turns_tokens_to_the_loop_at_once(srv, monkeypatch):
    """Thread mode: the shared batch gives a turn's tokens for every stream of the server's loop
    in one put_step on its decode thread (the sink), not a delivery per token on its workers."""
    from graphwrap.serve.api import client as client_mod

    turns = []
    real = client_mod._Inbox.put_step

    def put_step(self, feeds, tokens, logprobs=None):
        turns.append((threading.current_thread().name, len(feeds)))
        real(self, feeds, tokens, logprobs)

    monkeypatch.setattr(client_mod._Inbox, "put_step", put_step)
    tok = srv.served.tokenizer
    prompts = ["the quick brown", "a b", "hello there"]
    status, body, _ = post(srv.port, "/v1/completions", {"prompt": prompts, "max_tokens": 30, "temperature": 0})
    assert status == 200
    for choice in body["choices"]:
        assert choice["text"] == greedy(srv, tok(prompts[choice["index"]])["input_ids"], 30)[1]
    assert sum(n for _, n in turns) == 3 * 30, "every token through the sink"
    assert {name for name, _ in turns} == {"graphwrap-decode"}, turns
    assert max(n for _, n in turns) > 1, "one turn's tokens of several streams in one hand-over"


def test_chat_uses_the_template_and_streams_the_role_first(srv):
    tok = srv.served.tokenizer
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text",
                                                                                       "text": "a shared batch"}]}]
    text = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "a shared batch"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    _, want = greedy(srv, ids, 10)
    status, body, _ = post(srv.port, "/v1/chat/completions", {"messages": messages, "max_tokens": 10,
                                                               "temperature": 0})
    assert status == 200, body
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": want}
    assert body["usage"]["prompt_tokens"] == len(ids)
    status, evs = events(srv.port, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 10,
                                                            "temperature": 0})
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in evs[:-1])
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in evs[:-1]) == want
    assert evs[-2]["choices"][0]["finish_reason"] == "length" and evs[-2]["choices"][0]["delta"] == {}


def test_sampling_with_a_seed_repeats_and_n_gives_distinct_choices(srv):
    body = {"prompt": "graphs replay", "max_tokens": 16, "n": 3, "seed": 7, "temperature": 1.0}
    s1, a, _ = post(srv.port, "/v1/completions", body)
    s2, b, _ = post(srv.port, "/v1/completions", body)
    assert s1 == s2 == 200
    ta = [c["text"] for c in sorted(a["choices"], key=lambda c: c["index"])]
    tb = [c["text"] for c in sorted(b["choices"], key=lambda c: c["index"])]
    assert ta == tb
    assert len(set(ta)) > 1  # three draws of 16 tokens over ~380 ids
    assert a["usage"]["completion_tokens"] == 48
    # the next seed's first choice is not this one's second
    _, c, _ = post(srv.port, "/v1/completions", dict(body, n=1, seed=8))
    assert c["choices"][0]["text"] != ta[1]
    # streamed: the same texts, choice by choice
    _, evs = events(srv.port, "/v1/completions", body)
    streamed = ["", "", ""]
    for e in evs[:-1]:
        c = e["choices"][0]
        streamed[c["index"]] += c["text"]
    assert streamed == ta
    # several prompts: choice i * n + j is prompt i's
    _, c, _ = post(srv.port, "/v1/completions", {"prompt": ["the quick", "a shared"], "max_tokens": 4,
                                                 "temperature": 0, "n": 2})
    texts = [x["text"] for x in sorted(c["choices"], key=lambda x: x["index"])]
    tok = srv.served.tokenizer
    assert texts[0] == texts[1] == greedy(srv, tok("the quick")["input_ids"], 4)[1]
    assert texts[2] == texts[3] == greedy(srv, tok("a shared")["input_ids"], 4)[1]


def test_a_stop_string_cuts_the_text_and_frees_the_row(srv):
    tok = srv.served.tokenizer
    ids = tok("the lazy")["input_ids"]
    new, text = greedy(srv, ids, 40)
    # a stop string from the middle of the greedy text (ending it early)
    pieces = [tok.decode(new[:k], skip_special_tokens=True) for k in range(1, len(new))]
    k = next(i for i in range(3, len(pieces)) if len(pieces[i]) > len(pieces[2]) + 1 and "\ufffd" not in pieces[i])
    stop = pieces[k][len(pieces[2]):len(pieces[2]) + 2]
    want = text[:text.index(stop)]
    before = _ended(srv)
    for stream in (False, True):
        req = {"prompt": ids, "max_tokens": 40, "temperature": 0, "stop": [stop, "\u2603never"]}
        if stream:
            _, evs = events(srv.port, "/v1/completions", req)
            got = "".join(e["choices"][0]["text"] for e in evs[:-1])
            finish = evs[-2]["choices"][0]["finish_reason"]
        else:
            _, body, _ = post(srv.port, "/v1/completions", req)
            got, finish = body["choices"][0]["text"], body["choices"][0]["finish_reason"]
            assert body["usage"]["completion_tokens"] < 40
        assert got == want and finish == "stop"
    # each call ends (cancelled, or done where the GPU made its 40 tokens before the stop was read)
    _wait(lambda: _ended(srv) >= before + 2 and _decode_stats(srv)["rows_busy"] == 0)
    # a stop token id ends the sequence with it, as an end-of-sequence id would
    _, body, _ = post(srv.port, "/v1/completions", {"prompt": ids, "max_tokens": 40, "temperature": 0,
                                                     "stop_token_ids": [new[5]]})
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == new.index(new[5]) + 1


@pytest.mark.parametrize("body,status,words", [
    ({"prompt": "x", "max_tokens": 2, "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": "x", "max_tokens": 2, "logprobs": 2, "echo": True}, 400, "logprobs with echo"),
    ({"prompt": "x", "max_tokens": 2, "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "max_tokens": 2, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "max_tokens": 2, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": "x", "max_tokens": 2, "logit_bias": {"99999": 1}}, 400, "outside the model's vocabulary"),
    ({"prompt": "x", "max_tokens": 2, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "max_tokens": 300}, 400, "context of 256"),
    ({"prompt": [5, 99999], "max_tokens": 2}, 400, "outside the model's vocabulary"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "not served here"),
    ({"prompt": []}, 400, "empty prompt"),
    ({"prompt": ["the", ""], "max_tokens": 2}, 400, "empty prompt"),
    ({"prompt": [[5, 6], []], "max_tokens": 2}, 400, "empty prompt"),
    ({"prompt": "x", "max_tokens": 2, "n": 17}, 400, "n"),
    ({"prompt": ["x"] * 9, "max_tokens": 2, "n": 8}, 400, "at most 64"),
    (b"{not json", 400, "JSON"),
])
def test_bad_requests_get_their_status_and_the_reason(srv, body, status, words):
    got, answer, _ = post(srv.port, "/v1/completions", body)
    assert got == status, answer
    assert words.lower() in answer["error"]["message"].lower() or words.lower() in json.dumps(answer).lower()
    # the server goes on
    ok, again, _ = post(srv.port, "/v1/completions", {"prompt": "the", "max_tokens": 2, "temperature": 0})
    assert ok == 200 and again["usage"]["completion_tokens"] == 2


def test_log_probabilities_are_the_model_s_whole_streamed_and_in_chat(srv):
    model, tok = srv.served.gm.module, srv.served.tokenizer
    ids = tok("the quick brown")["input_ids"]
    want = model_logprobs(model, tok, ids, 6, 3)
    body = {"prompt": "the quick brown", "max_tokens": 6, "temperature": 0, "logprobs": 3}
    status, answer, _ = post(srv.port, "/v1/completions", body)
    assert status == 200, answer
    check_completion_logprobs(answer["choices"][0]["logprobs"], want, tok, ids, answer["choices"][0]["text"])
    status, evs = events(srv.port, "/v1/completions", body)
    parts = [e["choices"][0]["logprobs"] for e in evs[:-1] if e["choices"][0]["logprobs"]]
    streamed = {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    check_completion_logprobs(streamed, want, tok, ids, answer["choices"][0]["text"])
    _, plain, _ = post(srv.port, "/v1/completions", dict(body, logprobs=None))
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["text"] == answer["choices"][0]["text"]
    # chat: the same numbers in chat's form, for the template's prompt
    messages = [{"role": "user", "content": "the quick brown"}]
    chat_ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"]
    want = model_logprobs(model, tok, chat_ids, 4, 2)
    status, answer, _ = post(srv.port, "/v1/chat/completions", {"messages": messages, "max_tokens": 4,
                                                                 "temperature": 0, "logprobs": True, "top_logprobs": 2})
    assert status == 200, answer
    content = answer["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.decode([t], skip_special_tokens=False) for t, _, _ in want]
    for c, (t, v, best) in zip(content, want, strict=True):
        assert abs(c["logprob"] - v) < 1e-4 and c["bytes"] == list(c["token"].encode())
        assert [x["token"] for x in c["top_logprobs"]] == [tok.decode([i], skip_special_tokens=False) for i, _ in best]
        assert all(abs(x["logprob"] - w) < 1e-4 for x, (_, w) in zip(c["top_logprobs"], best, strict=True))
    s, body, _ = post(srv.port, "/v1/chat/completions", {"messages": messages, "top_logprobs": 2})
    assert s == 400 and "top_logprobs needs logprobs" in body["error"]["message"]


def test_log_probabilities_with_a_stop_string_and_n_follow_each_choice_s_tokens(srv):
    model, tok = srv.served.gm.module, srv.served.tokenizer
    ids = tok("the quick brown")["input_ids"]
    new, text = greedy(srv, ids, 10)
    want = model_logprobs(model, tok, ids, 10, 1)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    body = {"prompt": ids, "max_tokens": 10, "temperature": 0, "logprobs": 1, "stop": [stop], "n": 2}
    status, answer, _ = post(srv.port, "/v1/completions", body)
    assert status == 200, answer
    made = answer["usage"]["completion_tokens"] // 2  # (n=2: each choice's tokens, up to the one that ended it)
    assert made < 10
    for choice in answer["choices"]:
        assert choice["text"] == text[:text.index(stop)] and choice["finish_reason"] == "stop"
        check_completion_logprobs(choice["logprobs"], want[:made], tok, ids)
    status, evs = events(srv.port, "/v1/completions", body)
    for index in (0, 1):
        parts = [c["logprobs"] for e in evs[:-1] for c in e["choices"] if c["index"] == index and c["logprobs"]]
        check_completion_logprobs({k: [x for p in parts for x in p[k]] for k in parts[0]}, want[:made], tok, ids)


def test_chat_messages_are_checked(srv):
    s, body, _ = post(srv.port, "/v1/chat/completions", {"messages": [], "max_tokens": 2})
    assert s == 400 and "messages" in body["error"]["message"]
    s, body, _ = post(srv.port, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]})
    assert s == 400 and "only text is served" in body["error"]["message"]
    s, body, _ = post(srv.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                          "tools": [{"type": "function"}]})
    assert s == 400 and "tools" in body["error"]["message"]


class _Slow:
    """A forward hook that makes each call of the model take ``seconds`` (and a prompt's fail on
    ``bad``: decode steps, a token a row, never fail, since their padding rows hold whatever
    token their last sequence had)."""

    def __init__(self, model, seconds, bad=None):
        self.seconds, self.bad = seconds, bad
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.bad is not None and ids is not None and ids.shape[-1] > 1 and bool((ids == self.bad).any()):
            raise RuntimeError("the model refuses this prompt")
        time.sleep(self.seconds)

    def remove(self):
        self.handle.remove()


def test_a_client_that_goes_away_frees_its_row(srv):
    model = srv.served.gm.module
    slow = _Slow(model, 0.02)
    try:
        before, cancelled = _ended(srv), _decode_stats(srv)["cancelled"]
        # streamed: read a chunk, then hang up
        # (sampled: without ignore_eos a draw of the end-of-sequence id may end it before the hang-up)
        long = {"prompt": "the", "max_tokens": 200, "ignore_eos": True}
        c, _ = _stream_begun(srv.port, long)
        c.sock.close()
        c.close()
        # (on a GPU the 200 tokens may all be made before the hang-up is seen: the call is done)
        _wait(lambda: _ended(srv) >= before + 1 and _decode_stats(srv)["rows_busy"] == 0, 15)
        # whole: hang up while it runs
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        c.request("POST", "/v1/completions", json.dumps(long),
                  {"Content-Type": "application/json"})
        _wait(lambda: _decode_stats(srv)["rows_busy"] == 1 or _ended(srv) >= before + 2, 15)
        c.sock.close()
        c.close()
        _wait(lambda: _ended(srv) >= before + 2 and _decode_stats(srv)["rows_busy"] == 0, 15)
        if not torch.cuda.is_available():  # the slowed model ran past the hang-ups: each was cancelled
            assert _decode_stats(srv)["cancelled"] >= cancelled + 2
    finally:
        slow.remove()


def test_a_full_queue_answers_429_and_a_failing_request_fails_alone(srv):
    model, tok = srv.served.gm.module, srv.served.tokenizer
    bad = tok("fox")["input_ids"][0]
    slow = _Slow(model, 0.01, bad=bad)
    try:
        results = {}

        def send(name, body):
            results[name] = post(srv.port, "/v1/completions", body)

        # 4 rows and a queue of 4: 12 long requests at once, some must be refused
        threads = [threading.Thread(target=send, args=(i, {"prompt": "the", "max_tokens": 60, "temperature": 0}))
                   for i in range(12)]
        threads.append(threading.Thread(target=send, args=("bad", {"prompt": "fox", "max_tokens": 5})))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        statuses = [results[i][0] for i in range(12)]
        assert statuses.count(429) >= 1 and statuses.count(200) >= 4, statuses
        for i in range(12):
            status, body, headers = results[i]
            if status == 429:
                assert headers.get("retry-after") == "1" and "queue is full" in body["error"]["message"]
        texts = {results[i][1]["choices"][0]["text"] for i in range(12) if results[i][0] == 200}
        assert texts == {greedy(srv, tok("the")["input_ids"], 60)[1]}
        status, body, _ = results["bad"]
        if status != 429:
            assert status == 500 and "refuses this prompt" in body["error"]["message"]
        status, body, _ = post(srv.port, "/v1/completions", {"prompt": "fox", "max_tokens": 5})
        assert status == 500 and "refuses this prompt" in body["error"]["message"]
        status, evs = events(srv.port, "/v1/completions", {"prompt": "fox jumps", "max_tokens": 5})
        assert status == 500 and "refuses this prompt" in evs[0]["error"]["message"]
    finally:
        slow.remove()
    status, _, _ = post(srv.port, "/v1/completions", {"prompt": "the", "max_tokens": 3})
    assert status == 200


def test_a_call_the_batch_does_not_serve_that_fails_ends_its_streamer(srv):
    """The one-call loop (no_repeat_ngram_size here) ends a failing call's streamer as the batch does: the server's
    stream of such a call was left waiting for tokens that never came."""

    class Ends:
        ended = False

        def put(self, value):
            pass

        def end(self):
            self.ended = True

    tok = srv.served.tokenizer
    slow = _Slow(srv.served.gm.module, 0.0, bad=tok("fox")["input_ids"][0])
    try:
        s = Ends()
        fut = srv.served.gm.submit_generate(torch.tensor([tok("fox")["input_ids"]]), max_new_tokens=3, no_repeat_ngram_size=2,
                                            streamer=s)
        with pytest.raises(RuntimeError, match="refuses this prompt"):
            fut.result(timeout=30)
        assert s.ended
    finally:
        slow.remove()


def test_a_client_that_reads_slowly_holds_up_no_one_else_and_gets_its_whole_text(srv):
    tok = srv.served.tokenizer
    want = greedy(srv, tok("the lazy")["input_ids"], 100)[1]
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"prompt": "the lazy", "max_tokens": 100, "temperature": 0,
                                                     "stream": True}), {"Content-Type": "application/json"})
    r = c.getresponse()  # (not read while the others run)
    for _ in range(3):
        status, body, _ = post(srv.port, "/v1/completions", {"prompt": "a shared", "max_tokens": 40, "temperature": 0})
        assert status == 200 and body["choices"][0]["text"] == greedy(srv, tok("a shared")["input_ids"], 40)[1]
    time.sleep(0.5)
    evs = [json.loads(line[6:]) for line in r.read().decode().split("\n")
           if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in evs) == want
    c.close()


def test_a_model_changed_behind_the_server_is_served_as_it_is_now(srv):
    """model.double() after start: the batch is made again for the model as it is, and the answers
    are the changed model's."""
    model, tok = srv.served.gm.module, srv.served.tokenizer
    ids = tok("graphs replay")["input_ids"]
    model.double()
    try:
        status, body, _ = post(srv.port, "/v1/completions", {"prompt": ids, "max_tokens": 20, "temperature": 0})
        assert status == 200 and body["choices"][0]["text"] == greedy(srv, ids, 20)[1]
        assert next(model.parameters()).dtype == torch.float64
        assert srv.served.gm.__dict__["_gw_decode"].weights.changed() is False
    finally:
        model.float()


def test_models_health_and_metrics(srv):
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    c.request("GET", "/v1/models")
    models = json.loads(c.getresponse().read())
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256
    post(srv.port, "/v1/completions", {"prompt": "the", "max_tokens": 3})
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['graphwrap_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert values["graphwrap_generation_tokens_total"] >= 3
    assert values["graphwrap_time_to_first_token_seconds_count"] >= 1
    assert values['graphwrap_time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        values["graphwrap_time_to_first_token_seconds_count"]
    assert values["graphwrap_rows"] == 4 and "graphwrap_sequences_running" in values
    assert "graphwrap_cache_blocks_used" in values and "graphwrap_step_eager_calls" in values
    assert values["graphwrap_decode_turn_max_seconds"] >= values["graphwrap_decode_turn_p99_seconds"] > 0
    deadline = time.monotonic() + 5  # (sampled every 50 ms since the app started: the first may be due)
    while values["graphwrap_event_loop_lag_seconds_count"] < 1 and time.monotonic() < deadline:
        time.sleep(0.06)
        c.request("GET", "/metrics")
        values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                  for line in c.getresponse().read().decode().splitlines() if line and not line.startswith("#")}
    assert values["graphwrap_event_loop_lag_seconds_count"] >= 1
    c.request("GET", "/health")
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    srv.served.draining = True
    try:
        c.request("GET", "/health")
        r = c.getresponse()
        r.read()
        assert r.status == 503
        status, body, headers = post(srv.port, "/v1/completions", {"prompt": "the", "max_tokens": 3})
        assert status == 503 and headers.get("retry-after") == "1" and "shutting down" in body["error"]["message"]
    finally:
        srv.served.draining = False
    c.close()


def test_sigterm_lets_running_requests_finish_and_refuses_new_ones(model_dir):
    p, port = serve_cli(model_dir, "--drain", "20")
    try:
        _, r = _stream_begun(port, {"prompt": "the", "max_tokens": 240, "temperature": 0})
        p.send_signal(signal.SIGTERM)
        rest = r.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")
        assert '"finish_reason":"length"' in rest
        assert p.wait(60) == 0
        with pytest.raises(OSError):
            c2 = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c2.request("GET", "/health")
            c2.getresponse()
    finally:
        if p.poll() is None:
            p.kill()
        log = p.stdout.read() if p.stdout else ""
    assert "shutting down" in log, log


def test_while_draining_new_requests_get_503_and_the_running_stream_ends_whole(model_dir):
    """The drain as the first SIGTERM starts it (handle_exit called as the signal would): /health
    and a new request answer 503 while a slowed stream goes on to its [DONE]; then the server stops."""
    served = cli.load(_args(model_dir, rows=2))
    app = make_app(served)
    port = free_port()
    server = cli.draining_server()(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"), served, 30.0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait(lambda: server.started)
    slow = _Slow(served.gm.module, 0.01)
    try:
        _, r = _stream_begun(port, {"prompt": "the", "max_tokens": 120, "temperature": 0})
        server.handle_exit(signal.SIGTERM, None)
        status, body, headers = post(port, "/v1/completions", {"prompt": "the", "max_tokens": 3})
        assert status == 503 and headers["retry-after"] == "1" and "shutting down" in body["error"]["message"]
        h = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        h.request("GET", "/health")
        assert h.getresponse().status == 503
        assert served.active == 1 and thread.is_alive()  # the stream still runs
        rest = r.read().decode()
        assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in rest
        thread.join(30)
        assert not thread.is_alive() and served.active == 0
    finally:
        slow.remove()
        server.should_exit = True
        thread.join(30)
        served.engine.close(cancel=True, timeout=30)


def test_settings_follow_the_api_and_the_model_s_defaults():
    from graphwrap.serve.api.schemas import CompletionRequest, settings

    gen = argparse.Namespace(do_sample=True, temperature=0.6, top_p=0.9, top_k=40)
    kw = settings(CompletionRequest(prompt="x"), 5, gen, [2])
    assert kw == dict(max_new_tokens=5, min_new_tokens=0, repetition_penalty=1.0, eos_token_id=[2], do_sample=True,
                      temperature=0.6, top_p=0.9, top_k=40)
    greedy_model = argparse.Namespace(do_sample=False, temperature=1.0, top_p=1.0, top_k=50)
    kw = settings(CompletionRequest(prompt="x", top_p=0.5, stop_token_ids=[7, 2]), 5, greedy_model, [2])
    assert kw["do_sample"] and kw["temperature"] == 1.0 and kw["top_p"] == 0.5 and kw["top_k"] == 0
    assert kw["eos_token_id"] == [2, 7]
    kw = settings(CompletionRequest(prompt="x", temperature=0, ignore_eos=True), 5, gen, [2])
    assert kw["do_sample"] is False and kw["eos_token_id"] == []


def test_a_pad_id_in_a_prompt_is_a_token_of_it(srv):
    """The server's prompts carry no mask: every id is a token. A leading pad id was dropped (the
    prompt continued as if it were not there), a pad id inside sent the request to the one-call
    loop (slow, beside every other request), and with logprobs it was refused."""
    tok = srv.served.tokenizer
    pad = tok.convert_tokens_to_ids("<|end|>")
    body = tok("the quick brown")["input_ids"]
    old = tok.pad_token
    tok.pad_token = "<|end|>"  # (the tokenizer's pad id is the one the server passes)
    try:
        for ids in ([pad] + body, body[:1] + [pad] + body[1:], [pad, pad] + body):
            _, text = greedy(srv, ids, 8)  # (it passes a pad id the prompt does not hold: all its ids count)
            want = model_logprobs(srv.served.gm.module, tok, ids, 8, 1)  # (the same: the prompt's positions show)
            before = srv.served.gm.stats()["generate"].get("graphwrap's shared decode batch", 0)
            status, answer, _ = post(srv.port, "/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0,
                                                                   "logprobs": 1})
            assert status == 200, answer
            assert answer["choices"][0]["text"] == text
            check_completion_logprobs(answer["choices"][0]["logprobs"], want, tok, ids, text)
            assert answer["usage"]["prompt_tokens"] == len(ids)
            assert srv.served.gm.stats()["generate"]["graphwrap's shared decode batch"] == before + 1
    finally:
        tok.pad_token = old


@pytest.mark.parametrize("capture,want", [(None, ["first"]), ("ahead", ["every"]), ("lazy", [])])
def test_serve_captures_the_shapes_a_first_burst_meets_at_start_by_default(model_dir, monkeypatch, capture, want):
    """``--capture first`` (the default) asks the batch for the first shapes' graphs before it
    serves, ``ahead`` for every shape's, ``lazy`` for none."""
    from graphwrap import GraphedModule

    asked, real = [], GraphedModule.capture_generate

    def spy(self, timeout=None, shapes="every"):
        asked.append(shapes)
        return real(self, timeout, shapes)

    monkeypatch.setattr(GraphedModule, "capture_generate", spy)
    served = cli.load(cli.parser().parse_args([model_dir, "--engine", "thread", "--device", "cpu"]
                                              + ([] if capture is None else ["--capture", capture])))
    try:
        assert asked == want
    finally:
        served.engine.close(cancel=True, timeout=30)
