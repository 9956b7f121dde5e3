"""The server under the clients people use, on a CPU (a tiny GPT-2 of random weights):
LangChain's ``ChatOpenAI`` (``with_structured_output`` in its three methods, ``bind_tools`` and a
tool call's round trip through the history) and LiteLLM (a forced tool call, a stream). Each test
is skipped where its client is not installed (``pip install -e ".[clients]"``; CI installs them)."""

import json

import pytest

pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
pytest.importorskip("xgrammar", reason="needs XGrammar: pip install xgrammar")
pydantic = pytest.importorskip("pydantic")

import tiny_lm  # noqa: E402
from test_http_cpu import Running, _args  # noqa: E402

from graphwrap.serve.api import cli  # noqa: E402

ASK = "the quick brown fox"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Tokyo"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}


class Pet(pydantic.BaseModel):
    """A pet."""

    kind: str = pydantic.Field(json_schema_extra={"enum": ["cat", "dog"]})
    legs: int = pydantic.Field(ge=0, le=4)
    friendly: bool


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    r = Running(cli.load(_args(tiny_lm.make(str(tmp_path_factory.mktemp("tiny_lm"))), served_model_name="tiny",
                               rows=4, max_queue=16)))
    yield r
    r.stop()


def _chat(srv, seed=4, **kw):
    lc = pytest.importorskip("langchain_openai", reason='needs langchain-openai: pip install -e ".[clients]"')
    return lc.ChatOpenAI(model="tiny", base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0,
                         temperature=1.0, seed=seed, max_tokens=80, **kw)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_s_structured_output_gets_its_model(srv, method):
    got = _chat(srv).with_structured_output(Pet, method=method).invoke(ASK)
    assert isinstance(got, Pet) and got.kind in ("cat", "dog") and 0 <= got.legs <= 4


def test_langchain_s_json_mode_gets_json(srv):
    # (a seed whose JSON ends within max_tokens: a random model may write a string past them)
    got = _chat(srv, seed=1).with_structured_output(Pet, method="json_mode", include_raw=True).invoke(ASK)
    assert got["raw"].response_metadata["finish_reason"] == "stop"
    json.loads(got["raw"].content)  # (a random model's JSON, not the pet's fields: parsing it is all it can do)


def test_langchain_s_bound_tools_and_a_round_trip_through_the_history(srv):
    chat = _chat(srv)
    from langchain_core.messages import HumanMessage, ToolMessage

    called = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke([HumanMessage(ASK)])
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Tokyo")
    history = [HumanMessage(ASK), called, ToolMessage(json.dumps({"sky": "clear"}), tool_call_id=call["id"])]
    answer = chat.bind_tools([WEATHER]).invoke(history)
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
    assert isinstance(answer.content, str)


def test_litellm_s_forced_tool_call_and_stream(srv):
    litellm = pytest.importorskip("litellm", reason='needs litellm: pip install -e ".[clients]"')
    base = dict(model="openai/tiny", api_base=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_tokens=80,
                temperature=1.0, seed=3)
    r = litellm.completion(messages=[{"role": "user", "content": ASK}], tools=[WEATHER],
                           tool_choice={"type": "function", "function": {"name": "get_weather"}}, **base)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Tokyo")
    text = "".join(c.choices[0].delta.content or "" for c in
                   litellm.completion(messages=[{"role": "user", "content": ASK}], stream=True, **base))
    assert isinstance(text, str)
