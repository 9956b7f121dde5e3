"""A chat choice's text as the answer's message: whole (:func:`message`), or streamed, its tool
calls as they are made (``tool_choice`` ``required``, and ``auto``
with a parser): what each piece of its text adds to the stream's deltas.

Each choice has a :class:`CallStream`; ``feed(text)`` and, at the choice's end, ``end()`` return
events, in order:

- ``("content", text)``: more of the message's content;
- ``("call", k, name, arguments)``: tool call ``k`` begins (its first delta carries its id, type
  and name), with its arguments so far;
- ``("arguments", k, text)``: more of call ``k``'s arguments.

``required``: the output is the grammar's compact JSON list of ``{"name", "parameters"}``
objects; a call begins once its name is written, and its parameters stream as they are made (a
list cut by ``max_tokens`` leaves its last call's arguments cut, with finish ``length``).
``hermes``: content streams until a ``<tool_call>`` begins (a tag's first characters are held
back until they show they are not one); each call goes whole once its ``</tool_call>`` closes
it (or the text ends), and a block that does not parse is content. ``llama3_json``: a text that
begins as JSON (or with ``<|python_tag|>``) is held to its end and parsed then, as the whole
answer is; any other text is content as it comes.
"""

import json
from typing import Any, Dict, List, Optional, Tuple

from .tools import Shape, call, parse, read_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def message(text: str, shape: Shape) -> Tuple[Dict[str, Any], bool]:
    """``(the assistant's message, whether it calls tools)`` of a choice's whole text."""
    if shape.kind == "named":
        return _with_calls(None, [(shape.name or "", text)]), True
    if shape.kind == "required":
        calls = _parsed_list(text)
        if calls is not None:
            return _with_calls(None, calls), True
    if shape.kind == "parsed":
        content, calls = parse(text, shape.parser or "")
        if calls:
            return _with_calls(content, calls), True
    return {"role": "assistant", "content": text}, False


def _with_calls(content: Optional[str], calls: List[Tuple[str, str]]) -> Dict[str, Any]:
    return {"role": "assistant", "content": content or None,
            "tool_calls": [call(name, arguments) for name, arguments in calls]}


def _parsed_list(text: str) -> Optional[List[Tuple[str, str]]]:
    """The calls of a whole ``required`` list, each one's arguments as the model wrote them (as
    a stream sends them), or None where the text is not a whole list."""
    try:
        json.loads(text)
    except ValueError:
        return None  # (cut by max_tokens: the text is the content, finish "length")
    _, calls = deltas(_Required().feed(text))
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def call_stream(shape: Shape) -> "CallStream":
    if shape.kind == "required":
        return _Required()
    if shape.parser == "hermes":
        return _Hermes()
    return _Llama3()


class CallStream:
    called = False  # whether a call began (the choice's finish is then ``tool_calls``)

    def feed(self, text: str) -> List[tuple]:
        raise NotImplementedError

    def end(self) -> List[tuple]:
        return []


class _Required(CallStream):
    """The list ``[{"name": ..., "parameters": {...}}, ...]``, scanned as it comes (strings and
    their escapes followed, so that no brace or quote inside one counts)."""

    def __init__(self):
        self.text = ""
        self.at = 0  # the first character not scanned yet
        self.depth = 0
        self.in_str = self.esc = False
        self.str_from = -1  # where a string of the call's own level began (a key, or the name)
        self.expect_key = False
        self.key: Optional[str] = None
        self.args_from: Optional[int] = None  # where the parameters' value began (while it is read)
        self.sent = 0  # the text up to here is sent (or held in ``early``)
        self.k = -1
        self.name: Optional[str] = None
        self.early = ""  # parameters written before the name (not this grammar's order, but allowed)

    def feed(self, text: str) -> List[tuple]:
        self.text += text
        out: List[tuple] = []
        for i in range(self.at, len(self.text)):
            self._scan(i, self.text[i], out)
        self.at = len(self.text)
        if self.args_from is not None:
            self._arguments(len(self.text), out)
        return out

    def _scan(self, i: int, ch: str, out: List[tuple]):
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.str_from >= 0:
                    self._string(json.loads(self.text[self.str_from - 1:i + 1]), out)
                    self.str_from = -1
            return
        if ch == '"':
            self.in_str = True
            if self.depth == 2 and self.args_from is None:
                self.str_from = i + 1
        elif ch in "[{":
            self.depth += 1
            if self.depth == 2:  # a call's object
                self.k, self.name, self.key, self.expect_key, self.early = self.k + 1, None, None, True, ""
            elif self.depth == 3 and self.key == "parameters" and self.args_from is None:
                self.args_from = self.sent = i
        elif ch in "]}":
            self.depth -= 1
            if self.depth == 2 and self.args_from is not None:  # the parameters' value closed
                self._arguments(i + 1, out)
                self.args_from = None
        elif self.depth == 2 and ch == ",":
            self.expect_key = True

    def _string(self, value: str, out: List[tuple]):
        if self.expect_key:
            self.key, self.expect_key = value, False
        elif self.key == "name":
            self.name, self.called = value, True
            out.append(("call", self.k, value, self.early))
            self.early = ""

    def _arguments(self, upto: int, out: List[tuple]):
        more, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        if not more:
            return
        if self.name is None:
            self.early += more
        else:
            out.append(("arguments", self.k, more))


class _Hermes(CallStream):
    def __init__(self):
        self.text = ""
        self.sent = 0  # the text up to here went out (as content or as a call)
        self.k = -1
        self.spaces = ""  # whitespace held until content follows it
        self.begun = False  # content has begun (whitespace before it is dropped)

    def feed(self, text: str) -> List[tuple]:
        self.text += text
        out: List[tuple] = []
        while True:
            rest = self.text[self.sent:]
            j = rest.find(OPEN)
            if j < 0:
                keep = next((n for n in range(min(len(OPEN) - 1, len(rest)), 0, -1) if OPEN.startswith(rest[-n:])), 0)
                self._content(rest[:len(rest) - keep], out)
                self.sent += len(rest) - keep
                return out
            self._content(rest[:j], out)
            close = rest.find(CLOSE, j)
            if close < 0:
                self.sent += j
                return out
            self._block(rest[j:close + len(CLOSE)], rest[j + len(OPEN):close], out)
            self.sent += close + len(CLOSE)

    def end(self) -> List[tuple]:
        out: List[tuple] = []
        rest = self.text[self.sent:]
        if rest.startswith(OPEN):  # (a block the text's end closes, as the whole answer reads it)
            self._block(rest, rest[len(OPEN):], out)
        else:
            self._content(rest, out)
        self.sent = len(self.text)
        return out

    def _block(self, raw: str, inside: str, out: List[tuple]):
        got = read_call(inside.strip(), "arguments")
        if got is None:
            self._content(raw, out)
            return
        self.k += 1
        self.called = True
        self.spaces = ""  # (the whole answer's content is stripped around its calls)
        out.append(("call", self.k, got[0], got[1]))

    def _content(self, text: str, out: List[tuple]):
        if not text:
            return
        if not text.strip():
            self.spaces += text if self.begun else ""
            return
        if not self.begun:
            text, self.begun = text.lstrip(), True
        body = text.rstrip()  # (its trailing whitespace held: the whole answer's content is stripped)
        out.append(("content", self.spaces + body))
        self.spaces = text[len(body):]


class _Llama3(CallStream):
    def __init__(self):
        self.text = ""
        self.mode: Optional[str] = None  # "content" once the text shows it is no call, "calls" once it may be

    def feed(self, text: str) -> List[tuple]:
        self.text += text
        if self.mode is None:
            head = self.text.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return []
            self.mode = "calls" if head.startswith(("{", PYTHON_TAG)) else "content"
            return [("content", self.text)] if self.mode == "content" else []
        return [("content", text)] if self.mode == "content" and text else []

    def end(self) -> List[tuple]:
        if self.mode == "content":
            return []
        content, calls = parse(self.text, "llama3_json")
        if not calls:
            return [("content", content)] if content else []
        self.called = True
        return [("call", k, name, arguments) for k, (name, arguments) in enumerate(calls)]


def deltas(events: List[tuple]) -> Tuple[Optional[str], List[dict]]:
    """``(content, tool_calls)`` of one chunk's delta from ``events`` (a call's pieces joined)."""
    content: Optional[str] = None
    calls: List[dict] = []
    for e in events:
        if e[0] == "content":
            content = (content or "") + e[1]
        elif e[0] == "call":
            calls.append(dict(call(e[2], e[3]), index=e[1]))
        elif calls and calls[-1]["index"] == e[1]:
            calls[-1]["function"]["arguments"] += e[2]
        else:
            calls.append({"index": e[1], "function": {"arguments": e[2]}})
    return content, calls
