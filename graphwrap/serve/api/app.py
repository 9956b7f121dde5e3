"""The OpenAI-compatible HTTP app (FastAPI) over one GraphedModule's shared decode batch.

``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template), ``GET
/v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus' text). The handlers parse,
check, stream and count; every decision about tokens is the batch's (:mod:`.client`).

Every request ends on its own, every error in the API's shape (``{"error": {"message", "type",
"param", "code"}}``): a body that does not parse, a field the server does not know or serve or
out of its bounds, a token id outside the vocabulary, messages the chat template refuses, a
prompt past the context answer 400 with the reason; a missing or wrong API key 401
(:mod:`.guard`), an unknown path 404, a body over the limit 413; a full queue 429 and a server
shutting down 503, each with ``Retry-After``; a request whose model call fails 500 (in a stream:
an ``error`` event, then the end); a client that goes away, queued or running, cancels its
sequences, whose places the batch frees at its next step. Prompts are tokenized and templated
off the event loop (one thread), after their text's length is checked.

At shutdown, streams still running when the drain ends are cut (:meth:`Client.cut`): each gets
an ``error`` event and ``[DONE]``, and is logged with the tokens it was sent.
"""

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ...decoding.callers.errors import Closed, QueueFull
from ...decoding.callers.grammar import GrammarError, check
from . import logprobs
from .client import Client, Cut, Piece, TokenLogprob
from .engines import EngineGone, Failed, Unservable
from .guard import MAX_BODY, Guard
from .metrics import LAG_EVERY, Metrics
from .schemas import MAX_CHOICES, ChatRequest, CompletionRequest, Sampling, settings
from .tool_stream import CallStream, call_stream, deltas, message
from .tools import Shape, call, shape_of, template_tools

logger = logging.getLogger("graphwrap.serve")
MAX_NEW_DEFAULT = 2048  # a chat request without max_tokens: the context left, at most this
RETRY_AFTER = "1"
CHARS_PER_POSITION = 32  # a request's prompt text, at most this many characters per position of the context


class Refused(Exception):
    """A request answered with ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


@dataclass
class Served:
    """What the app serves: the engine that generates (:mod:`.engines`), the tokenizer, the limits."""

    engine: Any  # local.Local or remote.Remote
    tokenizer: Any
    name: str
    context: int  # positions a sequence may hold (prompt and new tokens)
    max_new_default: int = MAX_NEW_DEFAULT
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    active: int = 0  # requests being answered, streams until their end (event loop only)
    api_key: Optional[str] = None  # where set, every request needs it (:mod:`.guard`)
    key_everywhere: bool = False  # the key asked on /health and /metrics too
    max_body: int = MAX_BODY  # bytes of a request's body
    max_prompt_chars: Optional[int] = None  # characters of a request's prompt text (default: CHARS_PER_POSITION x context)
    tool_parser: Optional[str] = None  # how a chat's own tool calls are read (tools.parser_for)

    client: Any = None  # the app's Client (make_app sets it)

    def cut(self, reason: str) -> int:
        """End every request being answered with ``reason`` (shutdown, past the drain): how many
        sequences were cut."""
        return self.client.cut(reason) if self.client is not None else 0

    def prompt_chars(self) -> int:
        return self.max_prompt_chars if self.max_prompt_chars is not None else CHARS_PER_POSITION * self.context

    @property
    def gm(self):
        """The GraphedModule, where the batch runs in this process."""
        return self.engine.gm


def error_body(message: str, kind: str, param: Optional[str] = None) -> Dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def refusal(e: Refused) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER} if e.status in (429, 503) else None
    return JSONResponse(error_body(e.message, e.kind, e.param), status_code=e.status, headers=headers)


def as_refusal(e: BaseException) -> Refused:
    """The answer to a request whose sequences could not run."""
    if isinstance(e, Refused):
        return e
    if isinstance(e, QueueFull):
        return Refused(429, str(e), "rate_limit_error")
    if isinstance(e, Closed):
        return Refused(503, "the server is shutting down: it takes no new requests", "service_unavailable")
    if isinstance(e, EngineGone):
        return Refused(503, f"the server cannot generate: {e}", "service_unavailable")
    if isinstance(e, Unservable):
        return Refused(400, str(e))
    if isinstance(e, Cut):
        return Refused(503, str(e), "service_unavailable")
    kind = e.kind if isinstance(e, Failed) else type(e).__name__
    if kind == GrammarError.__name__:  # (a grammar its vocabulary cannot write: the request's, not the server's)
        return Refused(400, str(e), param="response_format")
    return Refused(500, f"the model failed on this request ({kind}: {e})", "server_error")


def make_app(served: Served) -> FastAPI:
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        start = getattr(served.engine, "start", None)  # (an engine that learns the model's facts from afar: ray_routed)
        if start is not None:
            await start()
            served.context = served.engine.context
        lag = asyncio.ensure_future(_sample_lag(metrics))
        try:
            yield
        finally:
            lag.cancel()

    app = FastAPI(title="graphwrap", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    client = Client(served.engine, served.tokenizer, metrics)
    # Tokenizing and chat templates: off the event loop, in one thread (a tokenizer is not for two at once).
    text_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphwrap-tokenize")
    app.state.served, app.state.metrics, app.state.client = served, metrics, client
    served.client = client
    app.add_middleware(Guard, api_key=served.api_key, everywhere=served.key_everywhere, max_body=served.max_body,
                       count=lambda path, status: metrics.requests.inc(endpoint=path, status=status))

    _errors_in_the_api_s_shape(app, metrics)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _answer(served, client, metrics, request, body, "/v1/completions", text_thread)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await _answer(served, client, metrics, request, body, "/v1/chat/completions", text_thread)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                            "owned_by": "graphwrap", "max_model_len": served.context}]}

    @app.get("/health")
    async def health():
        if served.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": RETRY_AFTER})
        gone = served.engine.gone()
        if gone is not None:
            return JSONResponse({"status": "failed", "reason": gone}, status_code=503)
        failed: Dict[int, str] = getattr(served.engine, "failed", dict)()  # (--data-parallel: the engines that ended)
        if failed:
            return {"status": "degraded", "failed_engines": {str(i): why for i, why in failed.items()}}
        return {"status": "ok"}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def _metrics():
        stats = await asyncio.get_running_loop().run_in_executor(None, served.engine.stats)
        text = metrics.render(stats, served.active)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def _errors_in_the_api_s_shape(app: FastAPI, metrics: Metrics):
    """FastAPI's own errors (a body that does not validate, an unknown path or method, a body that
    does not decode) answered in the API's shape, each counted."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _problems(request, exc.errors())
        metrics.requests.inc(endpoint=request.url.path, status="400")
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        kind = _KINDS.get(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.url.path} (the server serves /v1/completions, /v1/chat/completions, " \
                      "/v1/models, /health and /metrics)"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 400 and "parsing the body" in message:  # (FastAPI's words for bytes that do not decode)
            message = "the body is not valid JSON (it is not UTF-8 text, or does not parse)"
        metrics.requests.inc(endpoint=request.url.path, status=str(exc.status_code))
        return JSONResponse(error_body(message, kind), status_code=exc.status_code, headers=exc.headers)


_KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


def _problems(request: Request, errors) -> tuple:
    """``(message, param)`` of a body that did not validate: each problem with the field it is in."""
    kind = request.headers.get("content-type", "")
    if any(e.get("type") == "json_invalid" for e in errors):
        ctx = next((e.get("ctx") or {} for e in errors if e.get("type") == "json_invalid"), {})
        return f"the body is not valid JSON ({ctx.get('error', 'it does not parse')})", None
    if "json" not in kind.lower():
        said = f"Content-Type {kind!r}" if kind else "no Content-Type"
        return f"the body must be JSON, sent with 'Content-Type: application/json' (the request has {said})", None
    parts, param = [], None
    for e in errors:
        where = ".".join(str(x) for x in e["loc"][1:]) or "body"
        param = param or (where if where != "body" else None)
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts), param


async def _sample_lag(metrics: Metrics):
    """How late the event loop wakes for a timer, every LAG_EVERY seconds (into /metrics)."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + LAG_EVERY
        await asyncio.sleep(LAG_EVERY)
        metrics.loop_lag.observe(max(0.0, loop.time() - due))


# ---------------------------------------------------------------------------- a request


@dataclass
class Job:
    """One request as the batch will serve it."""

    id: str
    chat: bool
    prompts: List[List[int]]
    kwargs: Dict[str, Any]
    echo: List[str]  # per prompt, the text a choice starts with (completions' echo)
    arrived: float
    shape: Shape = Shape()  # a chat's output: text, JSON, tool calls (tools.py)
    draws: int = 1  # choices drawn per prompt (choice i is prompt i // draws's)


async def _answer(served: Served, client: Client, metrics: Metrics, request: Request,
                  body: Union[CompletionRequest, ChatRequest], endpoint: str, text_thread):
    arrived = time.perf_counter()
    served.active += 1
    streaming = False
    try:
        job = await asyncio.get_running_loop().run_in_executor(text_thread, _job, served, body, arrived)
        pieces = client.choices(job.prompts, body.drawn(), job.kwargs, body.stops(), body.seed, arrived,
                                body.scored(), aligned=not job.chat)
        if body.stream:
            # An error before the first token is answered with a status; a client that hangs up
            # meanwhile (its request queued, say) gives its place up at once.
            first = await _unless_gone(request, _first(pieces))
            if first is None:
                metrics.requests.inc(endpoint=endpoint, status="499")
                _log(metrics, job, _usage(job, []), "cancelled (the client went away before its first token)")
                return Response(status_code=499)
            metrics.requests.inc(endpoint=endpoint, status="200")
            streaming = True  # (the stream counts itself out at its end)

            async def end():
                served.active -= 1
                await pieces.aclose()  # type: ignore[attr-defined]

            return _Stream(_events(served, metrics, job, body, first, pieces), end)
        answer = await _unless_gone(request, _whole(served, metrics, job, body, pieces))
        metrics.requests.inc(endpoint=endpoint, status="200" if answer is not None else "499")
        return answer
    except BaseException as e:
        refused = as_refusal(e)
        metrics.requests.inc(endpoint=endpoint, status=str(refused.status))
        if refused.status >= 500 and not isinstance(e, (Closed, Refused)):
            logger.error("request failed: %s", refused.message, exc_info=e)
        return refusal(refused)
    finally:
        served.active -= 0 if streaming else 1


def _job(served: Served, body: Union[CompletionRequest, ChatRequest], arrived: float) -> Job:
    if served.draining:
        raise Refused(503, "the server is shutting down: it takes no new requests", "service_unavailable")
    if body.model is not None and body.model != served.name:
        raise Refused(404, f"the model {body.model!r} is not served here (it serves {served.name!r})",
                      "not_found_error", "model")
    tok = served.tokenizer
    info = served.engine.info
    most = served.prompt_chars()
    if isinstance(body, ChatRequest):
        if not getattr(tok, "chat_template", None):
            raise Refused(400, "this model's tokenizer has no chat template: use /v1/completions", param="messages")
        conversation = body.conversation()
        _check_chars(sum(len(m["content"]) for m in conversation), most, "messages")
        shape = _shape(served, body)
        try:
            text = tok.apply_chat_template(conversation, tools=template_tools(body), tokenize=False,
                                           add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template's own words (a role it does not take, say)
            raise Refused(400, f"the model's chat template refused these messages ({type(e).__name__}: {e})",
                          param="messages") from None
        prompts, limit, echo = [tok(text, add_special_tokens=False)["input_ids"]], body.limit(), [""]
    else:
        try:
            given = body.prompts()
        except ValueError as e:
            raise Refused(400, str(e), param="prompt") from None
        _check_chars(sum(len(p) for p in given if isinstance(p, str)), most, "prompt")
        for p in given:
            if not isinstance(p, str):
                _check_ids(p, info.vocab, "prompt")
        prompts = [tok(p)["input_ids"] if isinstance(p, str) else p for p in given]
        limit, shape = body.limit(), Shape()
        echo = [(p if isinstance(p, str) else tok.decode(p)) if body.echo else "" for p in given]
    _check_ids(body.stop_token_ids or [], info.vocab, "stop_token_ids")
    _check_ids(list(body.biased()), info.vocab, "logit_bias")
    if len(prompts) * body.drawn() > MAX_CHOICES:
        raise Refused(400, f"{len(prompts)} prompts x {body.drawn()} choices: at most {MAX_CHOICES}", param="n")
    if any(len(p) == 0 for p in prompts):
        raise Refused(400, "an empty prompt", param="prompt")
    longest = max(len(p) for p in prompts)
    if limit is None:
        limit = max(1, min(served.max_new_default, served.context - longest))
    if longest + limit > served.context:
        raise Refused(400, f"the prompt has {longest} tokens and max_tokens is {limit}: {longest + limit} positions, "
                           f"past the model's context of {served.context} (pass fewer tokens)", param="max_tokens")
    kwargs = settings(body, limit, info.generation, info.eos)
    kwargs["pad_token_id"] = _pad(served, info.eos)
    if shape.grammar is not None:
        kwargs["grammar"] = shape.grammar
    prefix = "chatcmpl-" if isinstance(body, ChatRequest) else "cmpl-"
    return Job(prefix + uuid.uuid4().hex, isinstance(body, ChatRequest), prompts, kwargs, echo, arrived, shape,
               body.drawn())


def _shape(served: Served, body: ChatRequest) -> Shape:
    """What the chat's output must match, its grammar checked (400 where it cannot compile)."""
    shape = shape_of(body, served.tool_parser)
    if shape.grammar is not None:
        try:
            check(shape.grammar)
        except GrammarError as e:
            raise Refused(400, str(e), param="tools" if shape.calls else "response_format") from None
    return shape


def _check_chars(n: int, most: int, param: str):
    if n > most:
        raise Refused(400, f"the prompt's text has {n} characters, more than this server takes ({most}: "
                           f"--max-prompt-chars sets it)", param=param)


def _check_ids(ids: List[int], vocab: Optional[int], param: str):
    bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise Refused(400, f"token id {bad} is outside the model's vocabulary of {vocab}", param=param)


def _pad(served: Served, eos: List[int]) -> int:
    pad = getattr(served.tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else (eos[0] if eos else 0)


async def _first(pieces: AsyncIterator[Piece]) -> Piece:
    try:
        return await pieces.__anext__()
    except BaseException:
        await pieces.aclose()  # type: ignore[attr-defined]
        raise


async def _unless_gone(request: Request, work):
    """``work``'s result, or None (and ``work`` cancelled) once the client has gone."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    logger.info("a client went away: its request was cancelled")
    return None


async def _disconnected(request: Request):
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(job: Job, pieces) -> Dict[str, int]:
    """The usage of a request whose choices' last pieces so far are ``pieces``."""
    prompt = sum(len(p) for p in job.prompts)
    made = sum(p.made for p in pieces)
    cached: Dict[int, int] = {}  # per prompt, the most any of its choices found in the prefix cache
    for p in pieces:
        at = p.index // job.draws
        cached[at] = max(cached.get(at, 0), p.cached)
    return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


def _head(served: Served, job: Job) -> Dict[str, Any]:
    return {"id": job.id, "object": "chat.completion" if job.chat else "text_completion",
            "created": int(time.time()), "model": served.name, "system_fingerprint": None}


async def _whole(served: Served, metrics: Metrics, job: Job, body: Sampling, pieces: AsyncIterator[Piece]):
    n = body.drawn()
    texts = [job.echo[i // n] for i in range(len(job.prompts) * n)]
    scored: List[List[TokenLogprob]] = [[] for _ in texts]
    ends: List[Piece] = []
    try:
        async for p in pieces:
            texts[p.index] += p.text
            scored[p.index] += p.logprobs or ()
            if p.finish is not None:
                ends.append(p)
    finally:  # (a client gone cancels this: its sequences are cancelled now, not when collected)
        await pieces.aclose()  # type: ignore[attr-defined]
    finishes = {p.index: p.finish for p in ends}
    if n > body.n:
        texts, scored, finishes = _best(texts, scored, finishes, n, body.n)
    asked = body.wanted_logprobs() is not None
    if job.chat:
        made = [message(t, job.shape) for t in texts]
        choices = [{"index": i, "message": m, "logprobs": logprobs.chat(scored[i]) if asked else None,
                    "finish_reason": "tool_calls" if called and finishes[i] == "stop" else finishes[i]}
                   for i, (m, called) in enumerate(made)]
    else:
        choices = [{"index": i, "text": t,
                    "logprobs": logprobs.completion(scored[i], len(job.echo[i // n]))[0] if asked else None,
                    "finish_reason": finishes[i]} for i, t in enumerate(texts)]
    usage = _usage(job, ends)
    _log(metrics, job, usage, "done")
    return dict(_head(served, job), choices=choices, usage=usage)


def _best(texts: List[str], scored: List[List[TokenLogprob]], finishes: Dict[int, Optional[str]], drawn: int,
          n: int):
    """Completions' ``best_of``: of each prompt's ``drawn`` choices, the ``n`` whose tokens are
    most likely (the sum of their log-probabilities), most likely first."""
    keep = []
    for start in range(0, len(texts), drawn):
        group = range(start, start + drawn)
        keep += sorted(group, key=lambda i: -sum(t.logprob for t in scored[i]))[:n]
    return [texts[i] for i in keep], [scored[i] for i in keep], {k: finishes[i] for k, i in enumerate(keep)}


def _log(metrics: Metrics, job: Job, usage: Dict[str, int], how: str):
    metrics.prompt_tokens.inc(usage["prompt_tokens"])
    logger.info("%s %s: %d prompt tokens, %d generated, %.3f s", job.id, how, usage["prompt_tokens"],
                usage["completion_tokens"], time.perf_counter() - job.arrived)


_FINISH = {None: "null", "stop": '"stop"', "length": '"length"', "tool_calls": '"tool_calls"'}


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _sse(obj: Any) -> str:
    return f"data: {_json(obj)}\n\n"


class _Chunks:
    """A stream's events as text. Each event is the same but for its choice: the rest is written
    once (a token's event costs the event loop, which every stream shares, a few microseconds
    instead of a dict's dump). ``last``: each choice's last piece so far (the tokens it was sent)."""

    def __init__(self, served: Served, job: Job, body: Sampling):
        self.job = job
        self.head = dict(_head(served, job), object="chat.completion.chunk" if job.chat else "text_completion")
        self.before = "data: " + _json(self.head)[:-1] + ',"choices":['
        self.after = "]" + (',"usage":null' if body.usage_in_stream() else "") + "}\n\n"
        self.running_usage = body.usage_in_chunks()
        self.offsets = [len(job.echo[i // body.n]) for i in range(len(job.prompts) * body.n)]  # (text_offset)
        self.last: Dict[int, Piece] = {}
        self.streams: Dict[int, CallStream] = {}  # each choice's tool calls found as its text comes
        self.named: set = set()  # choices whose named tool call has been begun

    def arguments(self, index: int, text: str, finish: Optional[str], scored: Optional[List[TokenLogprob]]) -> str:
        """More of a named tool call's arguments: the first time a choice's, the call's index,
        id, type and name with them; at its end, its finish (``tool_calls`` where it ended); their
        tokens' log-probabilities where asked for."""
        if index in self.named:
            delta: Dict[str, Any] = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        else:
            self.named.add(index)
            delta = {"tool_calls": [dict(call(self.job.shape.name or "", text), index=0)]}
        end = "tool_calls" if finish == "stop" else finish
        choice = {"index": index, "delta": delta, "logprobs": logprobs.chat(scored) if scored else None,
                  "finish_reason": end}
        return self.before + _json(choice) + self.after

    def scanned(self, index: int, text: str, finish: Optional[str], scored: Optional[List[TokenLogprob]]) -> str:
        """What a piece of a choice's text adds where its tool calls are found in it (tool_stream.py):
        content, calls begun (their index, id, type and name) and their arguments as they are made,
        with the piece's log-probabilities where asked for; "" where it adds nothing."""
        stream = self.streams.get(index)
        if stream is None:
            stream = self.streams[index] = call_stream(self.job.shape)
        events = stream.feed(text) + (stream.end() if finish is not None else [])
        if not events and not scored and finish is None:
            return ""
        content, calls = deltas(events)
        delta: Dict[str, Any] = {"content": content} if content is not None or not calls else {}
        if calls:
            delta["tool_calls"] = calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs.chat(scored) if scored else None,
                  "finish_reason": "tool_calls" if stream.called and finish == "stop" else finish}
        return self.before + _json(choice) + self.after

    def scores(self, index: int, scored: Optional[List[TokenLogprob]]) -> str:
        if not scored:
            return "null"
        if self.job.chat:
            return _json(logprobs.chat(scored))
        got, self.offsets[index] = logprobs.completion(scored, self.offsets[index])
        return _json(got)

    def chunk(self, index: int, text: str, finish: Optional[str], role: bool = False,
              scored: Optional[List[TokenLogprob]] = None) -> str:
        # (json.dumps without options reuses one encoder: a string's dump costs a microsecond, not five)
        end = _FINISH[finish]
        if self.job.chat:
            delta = ('{"role":"assistant","content":' + json.dumps(text) + "}" if role else
                     '{"content":' + json.dumps(text) + "}" if text or finish is None else "{}")
            choice = f'{{"index":{index},"delta":{delta},"logprobs":{self.scores(index, scored)},"finish_reason":{end}}}'
        else:
            choice = (f'{{"index":{index},"text":{json.dumps(text)},"logprobs":{self.scores(index, scored)},'
                      f'"finish_reason":{end}}}')
        if self.running_usage:  # (continuous_usage_stats: the usage so far in every chunk)
            return self.before + choice + ']' + ',"usage":' + _json(_usage(self.job, self.last.values())) + "}\n\n"
        return self.before + choice + self.after


async def _events(served: Served, metrics: Metrics, job: Job, body: Sampling, first: Piece,
                  pieces: AsyncIterator[Piece]) -> AsyncIterator[str]:
    """The stream: each choice's first chunk (chat: its role; completions: the echo), then text
    as it comes, each choice's end with its finish, the usage where asked for, ``[DONE]``."""
    c = _Chunks(served, job, body)
    chunk, last = c.chunk, c.last
    ends: List[Piece] = []
    how = "cancelled"
    try:
        for i in range(len(job.prompts) * body.n):
            if job.chat or job.echo[i // body.n]:
                yield chunk(i, job.echo[i // body.n], None, role=True)
        async for p in _chain(first, pieces):
            last[p.index] = p
            if p.finish is not None:
                ends.append(p)
            if job.shape.kind == "named":  # (its arguments as they come, in the call's deltas)
                yield c.arguments(p.index, p.text, p.finish, p.logprobs)
            elif job.shape.scanned:  # (tool calls found in the text as it comes)
                event = c.scanned(p.index, p.text, p.finish, p.logprobs)
                if event:
                    yield event
            elif p.text or p.finish is not None or p.logprobs:
                yield chunk(p.index, p.text, p.finish, scored=p.logprobs)
        if body.usage_in_stream():
            yield _sse(dict(c.head, choices=[], usage=_usage(job, ends)))
        how = "done"
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - the status was sent: the stream ends with the error
        refused = as_refusal(e)
        if isinstance(e, Cut):
            how = f"cut ({e})"
        else:
            how = f"failed ({refused.message})"
            logger.error("a streamed request failed: %s", refused.message, exc_info=e)
        yield _sse(error_body(refused.message, refused.kind))
        yield "data: [DONE]\n\n"
    finally:
        await pieces.aclose()  # type: ignore[attr-defined]
        _log(metrics, job, _usage(job, last.values()), how)


class _Stream(StreamingResponse):
    """A stream that ends in one place however it ends: sent whole, cut by the client, or never
    begun (a client gone before the first event, whose generator never ran its ``finally``)."""

    def __init__(self, events: AsyncIterator[str], end):
        super().__init__(events, media_type="text/event-stream")
        self.end = end

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.end()


async def _chain(first: Piece, rest: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    yield first
    async for p in rest:
        yield p

