"""The OpenAI request bodies the server takes, as pydantic models: a field the server does not
know is an error naming it (``extra="forbid"``), and a field it knows but does not serve
(penalties on presence, tools, the prompt's log-probabilities, ...) is an error too where it asks
for anything, never ignored. :func:`settings` turns a request into ``generate``'s keywords.

Every field is checked against its type and its bounds when the request arrives, as the API
types it: integers and booleans strictly (``"stream": "yes"`` and ``"n": "2"`` are refused, not
read), integers within 64 bits, numbers finite, ``min_tokens`` at most ``max_tokens``, stop
strings at most :data:`MAX_STOPS` of at most :data:`MAX_STOP_CHARS` characters. What depends on
the model (token ids within its vocabulary, positions within its context) is checked by the app.

Beside the API's own fields the server takes vLLM's extensions ``top_k``, ``min_tokens``,
``repetition_penalty``, ``stop_token_ids`` and ``ignore_eos``.
"""

import json
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # choices per request (prompts x n)
MAX_STOPS = 16
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_LOGPROBS = 20  # the most likely tokens a step reports, besides the one chosen
MAX_BIASED = 300  # tokens one logit_bias names
COMPLETION_TOKENS = 16  # a completion's max_tokens where the request leaves it out (the API's default)
INT64 = (1 << 63) - 1
# An integer of the API: strict (no string or float read as one), within int64.
Int = Annotated[StrictInt, Field(ge=-INT64 - 1, le=INT64)]
Id = Int  # a token id (the vocabulary is the app's check)


class Strict(BaseModel):
    """A body of the API: unknown fields refused, numbers finite, and a field sent as ``null``
    taken as left out (its default), as the API has it for every optional field."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # (vLLM's: the usage so far in every chunk)


class Sampling(Strict):
    """What completions and chat completions share."""

    model: Optional[str] = None
    max_tokens: Optional[Annotated[StrictInt, Field(ge=1, le=INT64)]] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[Annotated[StrictInt, Field(ge=-1, le=INT64)]] = None
    min_tokens: Annotated[StrictInt, Field(ge=0, le=INT64)] = 0
    repetition_penalty: Optional[float] = Field(None, gt=0)
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[Id]] = None
    ignore_eos: StrictBool = False
    seed: Optional[Annotated[StrictInt, Field(ge=-INT64 - 1, le=(1 << 64) - 1)]] = None
    user: Optional[str] = None  # the caller's end user, for their own logs: changes nothing here
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[Dict[str, Annotated[float, Field(ge=-100, le=100)]]] = Field(None, max_length=MAX_BIASED)

    @model_validator(mode="after")
    def _served(self):
        self.biased()
        unserved = self._unserved()
        if unserved:
            raise ValueError(f"{', '.join(unserved)}: not served by graphwrap's server (leave them out)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        stops = self.stops()
        if len(stops) > MAX_STOPS:
            raise ValueError(f"stop: at most {MAX_STOPS} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop: an empty stop string")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop: a stop string of {max(len(s) for s in stops)} characters (at most "
                             f"{MAX_STOP_CHARS})")
        limit = self.limit()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) is more than max_tokens ({limit})")
        return self

    def _unserved(self) -> List[str]:
        return []

    def limit(self) -> Optional[int]:
        """The most new tokens the request asks for (None: not said)."""
        return self.max_tokens

    def drawn(self) -> int:
        """Choices made per prompt (completions' ``best_of``: the ``n`` most likely are answered)."""
        return self.n

    def scored(self) -> Optional[int]:
        """The log-probabilities the choices are made with (``best_of`` ranks by them)."""
        return self.wanted_logprobs()

    def wanted_logprobs(self) -> Optional[int]:
        """How many of each step's most likely tokens to report with each token's own
        log-probability (0: its own alone), or None where none are asked for."""
        return None

    def biased(self) -> Dict[int, float]:
        """``logit_bias`` by token id (its keys are the ids' decimal text)."""
        out = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                out[int(k)] = v
            except ValueError:
                raise ValueError(f"logit_bias: a key is a token id, not {k!r}") from None
        return out

    def stops(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def usage_in_chunks(self) -> bool:
        """Whether every chunk carries the usage so far (``continuous_usage_stats``)."""
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(Sampling):
    prompt: Union[str, List[str], List[Id], List[List[Id]]]
    echo: StrictBool = False
    logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]] = None
    best_of: Optional[Annotated[StrictInt, Field(ge=1, le=MAX_N)]] = None
    suffix: Optional[str] = None

    def _unserved(self) -> List[str]:
        out = ["logprobs with echo (the prompt's log-probabilities)"] if self.logprobs is not None and self.echo else []
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) is less than n ({self.n})")
        if self.drawn() > self.n and self.stream:
            raise ValueError("best_of more than n cannot be streamed (the best are known at the end)")
        return out + (["suffix"] if self.suffix else [])

    def drawn(self) -> int:
        return self.best_of if self.best_of is not None else self.n

    def scored(self) -> Optional[int]:
        wanted = self.wanted_logprobs()
        return max(wanted or 0, 0) if self.drawn() > self.n else wanted

    def wanted_logprobs(self) -> Optional[int]:
        return self.logprobs

    def limit(self) -> int:
        return self.max_tokens if self.max_tokens is not None else COMPLETION_TOKENS

    def prompts(self) -> List[Union[str, List[int]]]:
        """Each prompt: its text or its token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("an empty prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ToolCall(Strict):
    """A tool call of an assistant's message in the history (the API's shape)."""

    id: Optional[str] = None
    type: str = "function"
    function: Dict[str, Any]


class Message(Strict):
    """A message of the history, with every field of the API's message types (an assistant's
    answer appended as the client got it: ``refusal``, ``annotations``, ``audio``,
    ``function_call`` and ``tool_calls``, null or set; a tool's answer with its ``tool_call_id``).
    Content is text, or a list of parts of which only text ones are served."""

    role: str
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    name: Optional[str] = None
    refusal: Optional[str] = None
    annotations: Optional[List[Any]] = None
    audio: Optional[Dict[str, Any]] = None
    function_call: Optional[Dict[str, Any]] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_call_id: Optional[str] = None

    @model_validator(mode="after")
    def _text_only(self):
        if isinstance(self.content, list):
            for part in self.content:
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(f"only text is served in a message's content (a part of type {kind!r})")
                if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise ValueError("a text part of a message's content is {'type': 'text', 'text': '...'}")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p["text"] for p in self.content)
        return self.content or ""

    def for_template(self) -> Dict[str, Any]:
        """The message as a chat template reads it (transformers' form: a tool call's arguments
        as a dict where they parse as JSON)."""
        out: Dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": dict(c.function, arguments=_arguments(
                c.function.get("arguments")))} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


class Function(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class Tool(Strict):
    type: Literal["function"] = "function"
    function: Function


class Named(Strict):
    name: str


class NamedChoice(Strict):
    type: Literal["function"] = "function"
    function: Named


class JsonSchema(Strict):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchema] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema: {'name': ..., 'schema': {...}}")
        return self


class ChatRequest(Sampling):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[Annotated[StrictInt, Field(ge=1, le=INT64)]] = None
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        names = [t.function.name for t in self.tools or []]
        if isinstance(self.tool_choice, NamedChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not one of the tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedChoice)
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format cannot be given with a tool_choice that forces a tool call")
        return self

    def wanted_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> List[Dict[str, Any]]:
        """The messages as a chat template reads them."""
        return [m.for_template() for m in self.messages]


def settings(req: Sampling, max_new: int, gen, eos: List[int]) -> Dict[str, Any]:
    """``generate``'s keywords for one sequence of ``req``.

    What the request leaves out comes from the model's generation config where it samples (its
    temperature, top_p and top_k), else from the API's defaults (temperature 1, no top-k, no
    top-p); temperature 0 is greedy. ``eos`` is the model's end-of-sequence ids."""
    samples = bool(getattr(gen, "do_sample", False))
    model_t = getattr(gen, "temperature", None) if samples else None
    t = req.temperature if req.temperature is not None else (model_t if model_t is not None else 1.0)
    kw: Dict[str, Any] = {"max_new_tokens": max_new, "min_new_tokens": req.min_tokens,
                          "repetition_penalty": req.repetition_penalty or 1.0}
    if req.presence_penalty or req.frequency_penalty:
        kw.update(presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0)
    if req.logit_bias:
        kw["sequence_bias"] = [[[t], b] for t, b in req.biased().items()]
    stop_ids = list(req.stop_token_ids or [])
    kw["eos_token_id"] = stop_ids if req.ignore_eos else list(dict.fromkeys(list(eos) + stop_ids))
    if t == 0:
        kw.update(do_sample=False)
        return kw
    top_p = req.top_p if req.top_p is not None else (getattr(gen, "top_p", None) if samples else None)
    top_k = req.top_k if req.top_k is not None else (getattr(gen, "top_k", None) if samples else None)
    kw.update(do_sample=True, temperature=float(t), top_p=float(top_p if top_p is not None else 1.0),
              top_k=int(top_k) if top_k is not None and top_k > 0 else 0)
    return kw
