"""What real clients send the server, on a CPU: a chat history built as the OpenAI SDK builds it
(each answer's message appended with its nulls), an agent's history (tool calls and the tools'
answers), explicit nulls for optional fields, vLLM's ``continuous_usage_stats`` (guidellm and
aiperf send it), an image part (refused, saying why), the sampling options vLLM serves
(``presence_penalty``, ``frequency_penalty``, ``logit_bias``: the batch's own tokens for them)."""

import json

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')

import tiny_lm  # noqa: E402
from test_http_cpu import Running, _args, events, greedy, post  # noqa: E402

from graphwrap.serve.api import cli  # noqa: E402


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    r = Running(cli.load(_args(tiny_lm.make(str(tmp_path_factory.mktemp("tiny_lm"))), served_model_name="tiny",
                               rows=4)))
    yield r
    r.stop()


def _template_ids(srv, messages):
    tok = srv.served.tokenizer
    return tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


def test_a_history_built_as_the_openai_sdk_builds_it_is_served(srv):
    openai = pytest.importorskip("openai", reason="needs the openai client: pip install openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none")
    messages = [{"role": "user", "content": "the quick brown"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    messages.append(first.choices[0].message.model_dump())  # (refusal, annotations, audio, tool_calls: null)
    assert {"refusal", "tool_calls", "function_call", "audio"} <= set(messages[-1])
    messages.append({"role": "user", "content": "a shared batch"})
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    assert second.choices[0].message.content == greedy(srv, _template_ids(srv, plain), 6)[1]
    assert second.usage.prompt_tokens == len(_template_ids(srv, plain))
    cached = second.usage.prompt_tokens_details.cached_tokens  # (the first turn's full blocks, its answer's too)
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0, second.usage


def test_an_agent_s_history_reaches_the_chat_template_in_transformers_form(srv):
    tok = srv.served.tokenizer
    old = tok.chat_template
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m.tool_calls %}"
                         "{% for c in m.tool_calls %}[{{ c.function.name }}({{ c.function.arguments.city }})]{% endfor %}"
                         "{% endif %}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}<|assistant|>")
    try:
        messages = [{"role": "user", "content": "weather?"},
                    {"role": "assistant", "content": None, "refusal": None,
                     "tool_calls": [{"id": "call_1", "type": "function",
                                     "function": {"name": "weather", "arguments": json.dumps({"city": "Oslo"})}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
        status, body, _ = post(srv.port, "/v1/chat/completions", {"messages": messages, "max_tokens": 4,
                                                                   "temperature": 0})
        assert status == 200, body
        text = "<|user|>weather?<|assistant|>[weather(Oslo)]<|tool|>cold#call_1<|assistant|>"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert body["usage"]["prompt_tokens"] == len(ids)
        assert body["choices"][0]["message"]["content"] == greedy(srv, ids, 4)[1]
    finally:
        tok.chat_template = old


def test_an_explicit_null_means_the_default(srv):
    body = {"prompt": "the", "max_tokens": 3, "temperature": 0, "n": None, "stream": None, "echo": None,
            "stop": None, "seed": None, "logprobs": None, "stream_options": None, "top_p": None, "user": None}
    status, answer, _ = post(srv.port, "/v1/completions", body)
    assert status == 200, answer
    assert len(answer["choices"]) == 1 and answer["usage"]["completion_tokens"] == 3
    status, answer, _ = post(srv.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                 "max_tokens": 2, "n": None, "logprobs": None,
                                                                 "top_logprobs": None, "tools": None})
    assert status == 200, answer


def test_continuous_usage_puts_the_usage_so_far_in_every_chunk(srv):
    status, evs = events(srv.port, "/v1/completions", {"prompt": "the quick", "max_tokens": 10, "temperature": 0,
                                                       "n": 2, "stream_options": {"include_usage": True,
                                                                                  "continuous_usage_stats": True}})
    assert status == 200 and evs[-1] == "[DONE]"
    chunks = [e for e in evs[:-1] if e["choices"]]
    made = [e["usage"]["completion_tokens"] for e in chunks]
    assert all(e["usage"]["prompt_tokens"] == evs[-2]["usage"]["prompt_tokens"] for e in chunks)
    assert made == sorted(made) and made[-1] == 20 and made[0] < 20
    assert evs[-2]["choices"] == [] and evs[-2]["usage"]["completion_tokens"] == 20


def test_an_image_part_is_refused_saying_only_text_is_served(srv):
    status, body, _ = post(srv.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    assert status == 400 and "only text is served" in body["error"]["message"], body
    assert "image_url" in body["error"]["message"]


def test_completion_log_probabilities_name_each_token_by_the_text_it_adds(tmp_path):
    """A word-level tokenizer (a word a token, decoded with spaces between): the text is
    " w6 w6 w6", and each token was named "w6" with offsets 0, 2, 4, which do not line up with it.
    Each token is now named by the text it adds (" w6"), its alternatives likewise, so the tokens
    make up the text and the offsets point into it."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import serve_openai

    model_dir = serve_openai.make_model("tiny", str(tmp_path / "words"), "cpu")
    r = Running(cli.load(_args(model_dir, served_model_name="words", rows=2)))
    try:
        for stream in (False, True):
            body = {"prompt": "w5 w6 w7", "max_tokens": 6, "temperature": 0, "logprobs": 2}
            if stream:
                status, evs = events(r.port, "/v1/completions", body)
                chunks = [e["choices"][0] for e in evs[:-1] if e["choices"]]
                text = "".join(c["text"] for c in chunks)
                parts = [c["logprobs"] for c in chunks if c["logprobs"]]
                lp = {k: [x for p in parts for x in p[k]] for k in ("tokens", "text_offset", "top_logprobs")}
            else:
                status, answer, _ = post(r.port, "/v1/completions", body)
                text, lp = answer["choices"][0]["text"], answer["choices"][0]["logprobs"]
            assert status == 200
            assert len(lp["tokens"]) == 6
            assert all(t.startswith(" w") for t in lp["tokens"]), lp["tokens"]
            assert "".join(lp["tokens"]) == text
            for token, offset, top in zip(lp["tokens"], lp["text_offset"], lp["top_logprobs"]):
                assert text[offset:offset + len(token)] == token
                assert token in top and all(k.startswith(" w") for k in top), top
    finally:
        r.stop()


def test_penalties_and_logit_bias_are_served_as_the_batch_serves_them(srv):
    """Over HTTP a completion's ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` give
    the tokens ``gm.generate`` gives with them (tests/test_generate_penalties_cpu.py checks those
    against transformers and the API's definition)."""
    gm, tok = srv.served.engine.gm, srv.served.tokenizer
    ids = tok("the quick brown")["input_ids"]
    for fields, kw in [({"presence_penalty": 1.5, "frequency_penalty": 0.5}, dict(presence_penalty=1.5,
                                                                                  frequency_penalty=0.5)),
                       ({"logit_bias": {"17": 5.0, "42": -100}}, dict(sequence_bias=[[[17], 5.0], [[42], -100.0]]))]:
        out = gm.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                          pad_token_id=tok.eos_token_id, **kw)[0, len(ids):].tolist()
        plain = gm.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                            pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        assert out != plain  # (they change the tokens)
        status, r, _ = post(srv.port, "/v1/completions", dict(fields, prompt=ids, max_tokens=12, min_tokens=12,
                                                               temperature=0, logprobs=0))
        assert status == 200, r
        assert r["choices"][0]["text"] == tok.decode(out, skip_special_tokens=True)


def test_best_of_answers_the_n_most_likely_of_its_choices(srv):
    """``best_of`` 4 and ``n`` 2: the 2 of the 4 choices (each as ``n`` 4 with the same seed makes
    it) whose tokens' log-probabilities sum highest, most likely first; the usage counts all 4."""
    body = {"prompt": "the quick brown", "max_tokens": 8, "temperature": 1.0, "seed": 11, "logprobs": 0}
    status, four, _ = post(srv.port, "/v1/completions", dict(body, n=4))
    assert status == 200, four
    ranked = sorted(four["choices"], key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    for fields in ({}, {"logprobs": None}):
        status, best, _ = post(srv.port, "/v1/completions", dict(body, n=2, best_of=4, **fields))
        assert status == 200, best
        assert [c["text"] for c in best["choices"]] == [c["text"] for c in ranked[:2]]
        assert [c["index"] for c in best["choices"]] == [0, 1]
        assert best["usage"]["completion_tokens"] == four["usage"]["completion_tokens"]
        assert (best["choices"][0]["logprobs"] is None) == ("logprobs" in fields)
    for bad, words in (({"n": 3, "best_of": 2}, "less than n"), ({"best_of": 2, "stream": True}, "streamed")):
        status, r, _ = post(srv.port, "/v1/completions", dict(body, **bad))
        assert status == 400 and words in r["error"]["message"], r
