"""The OpenAI request bodies the server takes, as pydantic models: a field the server does not
know is an error naming it (``extra="forbid"``), and a field it knows but does not serve
(penalties on presence, tools, the prompt's log-probabilities, ...) is an error too where it asks
for anything, never ignored. :func:`settings` turns a request into ``generate``'s keywords.

Beside the API's own fields the server takes vLLM's extensions ``top_k``, ``min_tokens``,
``repetition_penalty``, ``stop_token_ids`` and ``ignore_eos``.
"""

from typing import Any, Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # choices per request (prompts x n)
MAX_STOPS = 16
MAX_LOGPROBS = 20  # the most likely tokens a step reports, besides the one chosen


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """What completions and chat completions share."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    seed: Optional[int] = None
    user: Optional[str] = None  # the caller's end user, for their own logs: changes nothing here
    # Known, served only at the values that change nothing:
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, float]] = None

    @model_validator(mode="after")
    def _served(self):
        unserved = [name for name in ("presence_penalty", "frequency_penalty") if getattr(self, name)]
        unserved += ["logit_bias"] if self.logit_bias else []
        unserved += self._unserved()
        if unserved:
            raise ValueError(f"{', '.join(unserved)}: not served by graphwrap's server (leave them out)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if len(self.stops()) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(s == "" for s in self.stops()):
            raise ValueError("an empty stop string")
        return self

    def _unserved(self) -> List[str]:
        return []

    def wanted_logprobs(self) -> Optional[int]:
        """How many of each step's most likely tokens to report with each token's own
        log-probability (0: its own alone), or None where none are asked for."""
        return None

    def stops(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Sampling):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def _unserved(self) -> List[str]:
        out = ["logprobs with echo (the prompt's log-probabilities)"] if self.logprobs is not None and self.echo else []
        out += ["best_of"] if self.best_of is not None and self.best_of != self.n else []
        return out + (["suffix"] if self.suffix else [])

    def wanted_logprobs(self) -> Optional[int]:
        return self.logprobs

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


class TextPart(Strict):
    type: str
    text: str


class Message(Strict):
    role: str
    content: Optional[Union[str, List[TextPart]]] = None
    name: Optional[str] = None

    @model_validator(mode="after")
    def _text_only(self):
        if isinstance(self.content, list) and any(p.type != "text" for p in self.content):
            raise ValueError("only text parts are served in a message's content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(Sampling):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: Optional[Dict[str, Any]] = None
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def wanted_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _unserved(self) -> List[str]:
        out = ["response_format"] if self.response_format and self.response_format.get("type") != "text" else []
        out += ["tools"] if self.tools else []
        return out + (["tool_choice"] if self.tool_choice not in (None, "none", "auto") else [])

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> List[Dict[str, str]]:
        """The messages as a chat template reads them."""
        return [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in self.messages]


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
