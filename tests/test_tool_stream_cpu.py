"""A streamed choice's tool calls found as its text comes (graphwrap/serve/api/tool_stream.py):
whatever the pieces the text arrives in, the events add up to the whole answer's message (its
calls, their names and arguments, and its content), a call begins as soon as its name is known,
and braces, quotes and tags inside strings or cut between pieces are never taken for structure."""

import json
import random

import pytest

from graphwrap.serve.api.tool_stream import call_stream, deltas, message
from graphwrap.serve.api.tools import Shape

REQUIRED, HERMES, LLAMA3 = Shape("required"), Shape("parsed", parser="hermes"), Shape("parsed", parser="llama3_json")


def _pieces(text: str, seed: int):
    r = random.Random(seed)
    at, out = 0, []
    while at < len(text):
        n = r.choice([1, 1, 2, 3, 7, 20])
        out.append(text[at:at + n])
        at += n
    return out


def _assembled(shape: Shape, pieces):
    """(content, [(name, arguments)], called, the event at which each call began) of a stream."""
    s = call_stream(shape)
    content, calls, began = "", {}, []
    for i, piece in enumerate(pieces + [None]):
        events = s.feed(piece) if piece is not None else s.end()
        c, got = deltas(events)
        content += c or ""
        for d in got:
            if "id" in d:
                assert d["id"].startswith("call_") and d["type"] == "function"
                calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
                began.append(i)
            else:
                calls[d["index"]][1] += d["function"]["arguments"]
    return content or None, [tuple(calls[k]) for k in sorted(calls)], s.called, began


def _whole(text: str, shape: Shape):
    m, called = message(text, shape)
    return m["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []], called


@pytest.mark.parametrize("seed", range(6))
def test_a_required_list_streams_each_call_from_its_name_on(seed):
    params = [{"city": "Pa}ris\"{[", "days": 3, "more": [1, {"x": "]"}]}, {}, {"s": "\\\\\"\\u00e9"}]
    text = json.dumps([{"name": n, "parameters": p} for n, p in zip(["get_weather", "get_time", "f"], params)],
                      separators=(",", ":"))
    pieces = _pieces(text, seed)
    content, calls, called, began = _assembled(REQUIRED, pieces)
    assert (content, calls, called) == _whole(text, REQUIRED)
    assert [json.loads(a) for _, a in calls] == params
    # each call began at the piece that finished its name, long before the list's end
    ends = [text.index('"' + n + '"') + len(n) + 2 for n in ("get_weather", "get_time", "f")]
    done = [next(i for i in range(len(pieces)) if sum(map(len, pieces[:i + 1])) >= e) for e in ends]
    assert began == done


def test_parameters_before_the_name_go_with_the_calls_first_delta():
    text = '[{"parameters":{"a":1},"name":"f"}]'
    content, calls, called, _ = _assembled(REQUIRED, list(text))
    assert calls == [("f", '{"a":1}')] and called and content is None


def test_a_required_list_cut_by_max_tokens_leaves_its_last_call_cut():
    text = '[{"name":"f","parameters":{"a":1}},{"name":"g","parameters":{"b":"hel'
    _, calls, called, _ = _assembled(REQUIRED, _pieces(text, 1))
    assert calls == [("f", '{"a":1}'), ("g", '{"b":"hel')] and called


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("text", [
    'Sure, I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "<tool_call>"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    "No tools needed: 1 < 2, and <b>bold</b> stays. <tool_",
    'Bad block <tool_call>{"nam": 1}</tool_call> then text',
    'Cut <tool_call>{"name": "f", "arguments": {"a": 1}}',
    "  plain text with trailing space  ",
], ids=["two-calls", "tags-that-are-not", "unparsed-block", "unterminated", "spaces"])
def test_hermes_content_streams_and_each_call_goes_whole_once_closed(text, seed):
    content, calls, called, began = _assembled(HERMES, _pieces(text, seed))
    want_content, want_calls, want_called = _whole(text, HERMES)
    assert calls == want_calls and called == want_called
    assert (content or "").split() == (want_content or "").split(), "the same content, whitespace aside"
    if text.startswith("Sure"):
        pieces = _pieces(text, seed)
        first_close = text.index("</tool_call>") + len("</tool_call>")
        assert began[0] == next(i for i in range(len(pieces)) if sum(map(len, pieces[:i + 1])) >= first_close), \
            "the first call went out once its block closed, not at the end"


def test_hermes_content_comes_before_the_text_ends():
    s = call_stream(HERMES)
    got = [deltas(s.feed(p))[0] for p in ["Hello", " world", " <tool", "_call>", '{"name":"f","arguments":{}}']]
    assert got[:2] == ["Hello", " world"] and got[2:] == [None, None, None], got
    assert deltas(s.feed("</tool_call>"))[1][0]["function"]["name"] == "f"


@pytest.mark.parametrize("text", ['{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
                                  '<|python_tag|>{"name": "f", "parameters": {"a": 1}}',
                                  "Just words, { not a call", '{"not": "a call"}'])
def test_llama3_json_holds_json_to_the_end_and_streams_words(text):
    content, calls, called, began = _assembled(LLAMA3, _pieces(text, 3))
    assert (content, calls, called) == _whole(text, LLAMA3)
    s = call_stream(LLAMA3)
    first = deltas(s.feed(text[:6]))[0]
    assert first == (text[:6] if text.startswith("Just") else None), "words at once, JSON held"
