"""Structured output and tool calls of a chat request: what its output must match, and how its
text becomes the answer's message.

- ``response_format`` ``json_object`` or ``json_schema``: the output is constrained to JSON (to
  the schema), with or without ``strict``; the message's content is that JSON.
- ``tools`` go to the model's chat template, as transformers passes them.
- ``tool_choice`` ``required`` or a named function: the output is constrained to the call(s)'
  JSON (a named function: its arguments; required: a list of ``{"name", "parameters"}``, one of
  the tools each, one alone where ``parallel_tool_calls`` is false), and the message carries them
  as ``tool_calls`` (finish ``tool_calls``); streamed, a call's arguments come as they are
  made (``tool_stream.py``).
- ``tool_choice`` ``auto`` (or left out, with tools): the model's own format is parsed, by the
  parser ``--tool-call-parser`` names or the one its chat template shows: ``hermes`` (``<tool_call>``
  blocks of JSON, Qwen's and Hermes' templates) or ``llama3_json`` (a JSON object with ``name``
  and ``parameters``, Llama 3.1's); text that does not parse is the message's content.
- ``none``: the tools are shown to the model, its output is content.
"""

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ...decoding.callers.grammar import Grammar

PARSERS = ("auto", "hermes", "llama3_json", "none")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass(frozen=True)
class Shape:
    """What a chat request's output is: ``content`` (text, or JSON where ``grammar`` says),
    ``named`` (the arguments of ``name``), ``required`` (a list of calls) or ``parsed`` (text in
    which ``parser`` finds the model's own tool calls)."""

    kind: str = "content"
    grammar: Optional[Grammar] = None
    name: Optional[str] = None
    parser: Optional[str] = None

    @property
    def calls(self) -> bool:
        """Whether the output may hold tool calls."""
        return self.kind != "content"

    @property
    def scanned(self) -> bool:
        """Whether a stream's tool calls are found in its text as it comes (``tool_stream.py``; a
        named call's arguments are the text itself)."""
        return self.kind in ("required", "parsed")


def parser_for(tokenizer, asked: str = "auto") -> Optional[str]:
    """The tool-call parser of ``asked`` (``auto``: the one the chat template shows, if any)."""
    if asked != "auto":
        return None if asked == "none" else asked
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else json.dumps(template)
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3_json"
    return None


def shape_of(body, parser: Optional[str]) -> Shape:
    """The shape of a chat request's output (its fields checked by the schemas already)."""
    choice = body.tool_choice
    if body.tools and choice is not None and not isinstance(choice, str):
        name = choice.function.name
        return Shape("named", Grammar.json_schema(_parameters(_tool(body, name))), name)
    if body.tools and choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                    "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in body.tools]
        most = {"maxItems": 1} if body.parallel_tool_calls is False else {}
        return Shape("required", Grammar.json_schema({"type": "array", "minItems": 1, **most,
                                                      "items": {"anyOf": calls}}))
    fmt = body.response_format
    grammar = None
    if fmt is not None and fmt.type == "json_object":
        grammar = Grammar.json()
    elif fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        grammar = Grammar.json_schema(fmt.json_schema.schema_ or {"type": "object"})
    if body.tools and choice in (None, "auto") and parser is not None and grammar is None:
        return Shape("parsed", None, None, parser)
    return Shape("content", grammar)


def _tool(body, name: str):
    return next(t for t in body.tools if t.function.name == name)  # (the schema checked it is one)


def _parameters(tool) -> Dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def call(name: str, arguments: str) -> Dict[str, Any]:
    """A tool call in the API's shape, with an id of its own."""
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": arguments}}


def parse(text: str, parser: str) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """``(content, [(name, arguments JSON), ...])`` of a model's own tool-call format; a call
    that does not parse is left in the content."""
    if parser == "hermes":
        calls, kept = [], []
        last = 0
        for m in _HERMES.finditer(text):
            call = read_call(m.group(1), "arguments")
            if call is None:
                continue
            kept.append(text[last:m.start()])
            last = m.end()
            calls.append(call)
        kept.append(text[last:])
        return "".join(kept).strip() or None, calls
    if parser == "llama3_json":
        body = text.strip()
        body = body[len("<|python_tag|>"):].strip() if body.startswith("<|python_tag|>") else body
        calls = [c for c in (read_call(part, "parameters") for part in _split_json(body)) if c is not None]
        if calls and len(calls) == len(_split_json(body)):
            return None, calls
    return text, []


def read_call(raw: str, key: str) -> Optional[Tuple[str, str]]:
    """``(name, arguments JSON)`` of one call's JSON object (its arguments under ``key``, or the
    other name), or None where it is none."""
    try:
        got = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(got, dict) or not isinstance(got.get("name"), str):
        return None
    args = got.get(key, got.get("arguments" if key == "parameters" else "parameters", {}))
    return got["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _split_json(body: str) -> List[str]:
    """Objects one after another, split by ``;`` (Llama 3.1 writes several calls so)."""
    return [p for p in (s.strip() for s in body.split(";")) if p] if body.startswith("{") else []


def template_tools(body) -> Optional[List[Dict[str, Any]]]:
    """The tools as the chat template takes them (the API's own shape)."""
    return [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
