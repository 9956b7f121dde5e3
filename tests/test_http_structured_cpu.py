"""Structured output and tool calls over HTTP, on a CPU (a tiny GPT-2 of random weights): a
``response_format`` schema's output parses and validates, a forced tool call comes back as
``tool_calls`` whose arguments validate, streamed or not, through the official openai client too;
a schema or tool choice that cannot be served is a 400 naming its field. The parsers of models' own
tool-call formats are checked on their text."""

import json
import os
import sys

import pytest

pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
pytest.importorskip("uvicorn", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
pytest.importorskip("xgrammar", reason="needs XGrammar: pip install xgrammar")
jsonschema = pytest.importorskip("jsonschema", reason="needs jsonschema: pip install jsonschema")

import tiny_lm  # noqa: E402
from test_http_cpu import Running, _args, events, post  # noqa: E402

from graphwrap.serve.api import cli  # noqa: E402
from graphwrap.serve.api.tool_stream import message  # noqa: E402
from graphwrap.serve.api.tools import Shape, parse, parser_for  # noqa: E402

PERSON = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "mood": {"enum": ["happy", "sad"]}, "pets": {"type": "boolean"}},
          "required": ["age", "mood", "pets"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Tokyo"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tiny_lm.make(str(tmp_path_factory.mktemp("tiny_lm")))
    r = Running(cli.load(_args(d, served_model_name="tiny", rows=4, max_queue=16)))
    yield r
    r.stop()


def _args_of(call, tools):
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call["type"] == "function" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), params[call["function"]["name"]])


def test_a_json_schema_s_output_parses_and_validates(srv):
    status, r, _ = post(srv.port, "/v1/chat/completions", {
        "messages": ASK, "max_tokens": 120, "n": 3, "temperature": 1.0, "seed": 7,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                   "strict": True}}})
    assert status == 200, r
    for c in r["choices"]:
        assert c["finish_reason"] == "stop"
        jsonschema.validate(json.loads(c["message"]["content"]), PERSON)


def test_json_object_is_json(srv):
    status, r, _ = post(srv.port, "/v1/chat/completions", {
        "messages": ASK, "max_tokens": 200, "n": 4, "temperature": 1.0, "seed": 3,
        "response_format": {"type": "json_object"}})
    assert status == 200, r
    ended = [c for c in r["choices"] if c["finish_reason"] == "stop"]
    assert ended, r  # (a random model may write a long string: those are cut, finish "length")
    for c in ended:
        json.loads(c["message"]["content"])


def test_a_named_tool_choice_comes_back_as_a_tool_call_whole_or_streamed(srv):
    """Streamed, the call's arguments come as they are made: its first delta carries its index, id,
    type and name, the later ones more of its arguments, which add up to the whole answer's."""
    body = {"messages": ASK, "max_tokens": 100, "tools": [WEATHER, CLOCK], "temperature": 1.0, "seed": 1,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    status, r, _ = post(srv.port, "/v1/chat/completions", body)
    assert status == 200, r
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (whole,) = choice["message"]["tool_calls"]
    assert whole["function"]["name"] == "get_weather"
    _args_of(whole, [WEATHER, CLOCK])
    status, evs = events(srv.port, "/v1/chat/completions", body)
    assert status == 200 and evs[-1] == "[DONE]", evs
    deltas = [e["choices"][0] for e in evs[:-1] if e["choices"]]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    calls = [c for d in deltas for c in d["delta"].get("tool_calls") or []]
    assert len(calls) > 2 and {c["index"] for c in calls} == {0}  # (the arguments in several deltas)
    first = calls[0]
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == whole["function"]["arguments"]


def test_the_openai_client_s_stream_assembles_the_named_call(srv):
    openai = pytest.importorskip("openai", reason="needs the openai client: pip install openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0)
    with client.chat.completions.stream(model="tiny", messages=ASK, max_tokens=100, temperature=1.0, seed=1,
                                        tools=[WEATHER], tool_choice={"type": "function",
                                                                      "function": {"name": "get_weather"}}) as s:
        for _ in s:
            pass
        done = s.get_final_completion()
    (call,) = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    _args_of(call.model_dump(), [WEATHER])


def test_the_openai_client_s_stream_assembles_a_required_call(srv):
    openai = pytest.importorskip("openai", reason="needs the openai client: pip install openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0)
    kw = dict(model="tiny", messages=ASK, max_tokens=150, temperature=1.0, seed=5, tools=[WEATHER, CLOCK],
              tool_choice="required", parallel_tool_calls=False)
    with client.chat.completions.stream(**kw) as s:
        for _ in s:
            pass
        done = s.get_final_completion()
    whole = client.chat.completions.create(**kw)
    (call,) = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, call.function.arguments) == (whole.choices[0].message.tool_calls[0].function.name,
                                                              whole.choices[0].message.tool_calls[0].function.arguments)
    _args_of(call.model_dump(), [WEATHER, CLOCK])


def test_a_required_tool_choice_calls_one_of_the_tools_or_more(srv):
    status, r, _ = post(srv.port, "/v1/chat/completions", {
        "messages": ASK, "max_tokens": 150, "tools": [WEATHER, CLOCK], "tool_choice": "required", "n": 2,
        "temperature": 1.0, "seed": 5, "parallel_tool_calls": False})
    assert status == 200, r
    for choice in r["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]  # (parallel_tool_calls false: one)
        _args_of(call, [WEATHER, CLOCK])


def test_a_required_call_streams_from_its_name_on_and_adds_up_to_the_whole_answer(srv):
    """Streamed, a required list's calls begin (index, id, type, name) as soon as each name is
    written and their arguments follow as they are made; assembled, the stream is the whole
    answer of the same seed."""
    body = {"messages": ASK, "max_tokens": 150, "tools": [WEATHER, CLOCK], "tool_choice": "required",
            "temperature": 1.0, "seed": 5, "parallel_tool_calls": False}
    status, r, _ = post(srv.port, "/v1/chat/completions", body)
    assert status == 200 and r["choices"][0]["finish_reason"] == "tool_calls", r
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in r["choices"][0]["message"]["tool_calls"]]
    status, evs = events(srv.port, "/v1/chat/completions", body)
    assert status == 200 and evs[-1] == "[DONE]", evs
    deltas = [e["choices"][0] for e in evs[:-1] if e["choices"]]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    calls: dict = {}
    carrying = [i for i, d in enumerate(deltas) if d["delta"].get("tool_calls")]
    for d in deltas:
        for c in d["delta"].get("tool_calls") or []:
            if "id" in c:
                assert c["index"] not in calls and c["type"] == "function"
                calls[c["index"]] = [c["function"]["name"], c["function"]["arguments"]]
            else:
                calls[c["index"]][1] += c["function"]["arguments"]
    assert [tuple(calls[k]) for k in sorted(calls)] == whole
    assert len(carrying) > 2 and carrying[0] < len(deltas) - 1, "the calls came in several deltas, before the end"
    for name, arguments in whole:
        _args_of({"type": "function", "id": "call_x", "function": {"name": name, "arguments": arguments}},
                 [WEATHER, CLOCK])


def test_the_openai_client_s_parse_gets_its_model(srv):
    openai = pytest.importorskip("openai", reason="needs the openai client: pip install openai")
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        age: int
        happy: bool

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0)
    r = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Person, max_tokens=60, seed=2,
                                      temperature=1.0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(r.choices[0].message.parsed, Person)
    else:  # (a long integer of a random model, cut: its prefix is JSON's)
        assert r.choices[0].message.content.startswith('{"age": ')


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "xml"}}, "response_format", ""),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "", "not one of"),
    ({"tool_choice": "required"}, "", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", ""),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "",
     "cannot be given"),
])
def test_what_cannot_be_served_gets_400_naming_it(srv, body, param, words):
    status, r, _ = post(srv.port, "/v1/chat/completions", dict(body, messages=ASK, max_tokens=5))
    assert status == 400, r
    assert words in r["error"]["message"]
    assert param in (r["error"].get("param") or "") + r["error"]["message"]


def test_hermes_tool_calls_are_parsed_and_the_rest_is_content():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    content, calls = parse(text, "hermes")
    assert content == "Let me look."
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris", "days": 2}),
                                                      ("get_time", {"zone": "UTC"})]
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse(broken, "hermes") == (broken, [])
    m, called = message(text, Shape("parsed", parser="hermes"))
    assert called and m["content"] == "Let me look." and len(m["tool_calls"]) == 2


def test_llama3_json_tool_calls_are_parsed_and_plain_text_is_content():
    content, calls = parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', "llama3_json")
    assert content is None and [(n, json.loads(a)) for n, a in calls] == [("get_time", {"zone": "CET"})]
    two = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    assert [n for n, _ in parse(two, "llama3_json")[1]] == ["a", "b"]
    assert parse("Paris is sunny.", "llama3_json") == ("Paris is sunny.", [])
    assert parse('{"city": "Paris"}', "llama3_json") == ('{"city": "Paris"}', [])  # (JSON, not a call)


def test_the_parser_is_the_one_the_chat_template_shows():
    class Tok:
        chat_template = ""

    t = Tok()
    assert parser_for(t) is None
    t.chat_template = "{% if tools %}<tool_call>{{ tools }}</tool_call>{% endif %}"
    assert parser_for(t) == "hermes"
    t.chat_template = "{{- '<|python_tag|>' }}"
    assert parser_for(t) == "llama3_json"
    assert parser_for(t, "none") is None and parser_for(t, "hermes") == "hermes"


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"],
                         ids=["named", "required"])
def test_a_streamed_tool_call_carries_its_tokens_log_probabilities(srv, choice):
    """Asked for, every token's log-probability comes with the call's stream (a named call's with
    its arguments as they come, a required call's with the message at the end), as in the whole
    answer."""
    body = {"messages": ASK, "max_tokens": 100, "tools": [WEATHER], "temperature": 1.0, "seed": 1,
            "tool_choice": choice, "logprobs": True, "top_logprobs": 2,
            "stream_options": {"include_usage": True}}
    status, r, _ = post(srv.port, "/v1/chat/completions", dict(body, stream_options=None))
    assert status == 200, r
    want = [t["token"] for t in r["choices"][0]["logprobs"]["content"]]
    status, evs = events(srv.port, "/v1/chat/completions", body)
    assert status == 200 and evs[-1] == "[DONE]", evs
    got = [t for e in evs[:-1] for ch in e["choices"] for t in (ch["logprobs"] or {}).get("content") or []]
    assert [t["token"] for t in got] == want
    assert len(want) == evs[-2]["usage"]["completion_tokens"] and all(len(t["top_logprobs"]) == 2 for t in got)


def test_a_grammar_the_vocabulary_cannot_write_is_a_400(tmp_path):
    """A word-level vocabulary (serve_openai.py's ``w0``, ``w1``, ...) cannot write JSON: the request
    is answered 400 saying so, in this process's batch and in an engine process of its own."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import serve_openai

    d = serve_openai.make_model("tiny", str(tmp_path / "words"), "cpu")
    for engine in ("thread", "process"):
        r = Running(cli.load(_args(d, served_model_name="w", rows=2, device="cpu", engine=engine)))
        try:
            status, body, _ = post(r.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "w5 w6"}],
                                                                   "max_tokens": 8,
                                                                   "response_format": {"type": "json_object"}})
            assert status == 400 and "cannot be written" in body["error"]["message"], (engine, body)
            status, body, _ = post(r.port, "/v1/completions", {"prompt": "w5 w6", "max_tokens": 4})
            assert status == 200, body
        finally:
            r.stop()
