"""The server's way into the shared decode batch: each sequence queued on the engine
(:mod:`.engines`: the batch in this process or in a child) with a feed that hands its tokens to
the request's own asyncio queue, drained by the request's task (never by a callback on the
engine's threads).

A sequence's tokens become text (:mod:`.text`); a stop string found ends it there and cancels
its call, which frees its row at the batch's next step; a request that goes away (a client that
disconnects, a task cancelled) cancels every call it has, in the ``finally`` of its stream.
"""

import asyncio
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Set, Tuple

from ...decoding.callers.logprobs import Logprobs
from .metrics import Metrics
from .text import Detokenizer, StopText, decoder

_END = object()


@dataclass(slots=True)
class TokenLogprob:
    """A token as the API reports it: its text, its log-probability, and the step's most likely
    tokens (text, log-probability), most likely first."""

    text: str
    logprob: float
    top: List[Tuple[str, float]]


@dataclass(slots=True)
class Piece:
    """Text of one choice: more of it, or its end (``finish`` set, ``tokens`` its count);
    ``logprobs``: one for each token this piece took in, where the request asked; ``made``: the
    choice's tokens so far, this piece's included."""

    index: int
    text: str
    finish: Optional[str] = None  # "stop" or "length" at the end
    tokens: int = 0
    logprobs: Optional[List[TokenLogprob]] = None
    made: int = 0
    cached: int = 0  # at the end: tokens of its prompt the batch found in the prefix cache


class Cut(Exception):
    """A sequence cut short by the server (its shutdown's drain ended before it did)."""


@dataclass(slots=True)
class _Scored:
    """Tokens with their log-probabilities, as the engine hands them to a feed that asked."""

    tokens: List[int]
    logprobs: List[Any]


def _seed(seed: Optional[int], index: int) -> Optional[int]:
    """Choice ``index``'s seed: its own, and no two requests' seeds give one choice the same."""
    return None if seed is None else (seed * 0x9E3779B1 + index) % (1 << 63)


class _Inbox:
    """Tokens for the sequences of one event loop, handed over in one wake-up of the loop however
    many sequences got tokens meanwhile (a wake-up per token would cost the loop more than the
    token). A batch in this process hands it a turn's tokens at once on its decode thread
    (:meth:`put_step`); the engine process's receiver, one message's."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()  # guards items and scheduled
        self.items: List[Tuple["asyncio.Queue[Any]", Any]] = []
        self.scheduled = False

    def post(self, queue: "asyncio.Queue[Any]", item: Any):
        self.post_many([(queue, item)])

    def post_many(self, items: List[Tuple["asyncio.Queue[Any]", Any]]):
        with self.lock:
            self.items.extend(items)
            if self.scheduled:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def put_step(self, feeds: List["_Feed"], tokens: List[int], logprobs: Optional[List[Any]] = None):
        """A decode turn's tokens, one for each of ``feeds``, and their log-probabilities where a
        sequence asked: the shared batch's sink (:class:`~graphwrap.decoding.callers.calls.Sinks`), called
        on its decode thread once a turn for every sequence of this loop, so that no token takes
        a delivery of its own on the batch's workers."""
        if logprobs is None:
            self.post_many([(f.queue, [t]) for f, t in zip(feeds, tokens)])
        else:
            self.post_many([(f.queue, [t] if lp is None else _Scored([t], [lp]))
                            for f, t, lp in zip(feeds, tokens, logprobs)])

    def _drain(self):
        with self.lock:
            items, self.items, self.scheduled = self.items, [], False
        for queue, item in items:
            queue.put_nowait(item)


class _Feed:
    """A sequence's tokens into its asyncio queue (from whatever thread the engine hands them on).
    Its ``sink`` and ``key`` (its inbox and itself) let a batch in this process hand a turn's
    tokens for every feed of the loop over at once (:meth:`_Inbox.put_step`)."""

    __slots__ = ("inbox", "queue", "logprobs", "hits")

    def __init__(self, inbox: _Inbox, queue: "asyncio.Queue[Any]", logprobs: Optional[int] = None):
        self.inbox, self.queue, self.logprobs = inbox, queue, logprobs
        self.hits = 0  # prompt tokens the batch found cached

    @property
    def sink(self) -> _Inbox:
        return self.inbox

    @property
    def key(self) -> "_Feed":
        return self

    def add(self, tokens: List[int], logprobs: Optional[List[Any]] = None):
        self.inbox.post(self.queue, tokens if logprobs is None else _Scored(tokens, logprobs))

    def end(self):
        self.inbox.post(self.queue, _END)

    def cached(self, n: int):  # (before its end: the batch tells it when the sequence is admitted)
        self.hits = n


def _taken(queue: "asyncio.Queue[Any]", got: Any) -> Tuple[List[int], List[Any], bool]:
    """``got`` and every token come meanwhile, for one piece: ``(tokens, their log-probabilities
    where asked, whether the sequence's end came)``; a :class:`Cut` is raised."""
    tokens: List[int] = []
    scores: List[Any] = []
    while got is not _END:
        kind = type(got)
        if kind is _Scored:
            tokens += got.tokens
            scores += got.logprobs
        elif kind is Cut:
            raise got
        else:
            tokens += got
        if queue.empty():
            break
        got = queue.get_nowait()
    return tokens, scores, got is _END


class Client:
    """Generation for the HTTP handlers, over an engine (:mod:`.engines`) and the tokenizer."""

    def __init__(self, engine, tokenizer, metrics: Metrics):
        self.engine, self.tok, self.metrics = engine, tokenizer, metrics
        self.decode = decoder(tokenizer)
        self.texts: Dict[int, str] = {}  # a token's own text (log-probabilities name tokens so)
        self.inboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Inbox]" = weakref.WeakKeyDictionary()
        self.live: Set["asyncio.Queue[Any]"] = set()  # the queues of the sequences being answered (event loop only)

    def cut(self, reason: str) -> int:
        """End every sequence being answered with :class:`Cut` (``reason``): each request then ends
        as a failed one does, a stream with an error event and ``[DONE]`` (called on the event
        loop). How many were cut."""
        for queue in self.live:
            queue.put_nowait(Cut(reason))
        return len(self.live)

    async def choices(self, prompts: Sequence[List[int]], n: int, kwargs: Dict[str, Any], stops: Sequence[str],
                      seed: Optional[int], arrived: float, logprobs: Optional[int] = None,
                      aligned: bool = False) -> AsyncIterator[Piece]:
        """Every choice's pieces as they come (choice ``i * n + j`` is prompt ``i``'s ``j``-th),
        each choice's last piece with its finish. Leaving the loop early cancels what is left.
        ``logprobs`` (k): each token's log-probability and the step's k most likely tokens, named
        by their own text, or (``aligned``) by the text each adds to the choice's text there (the
        chosen tokens' texts then make up the text, as completions' ``text_offset`` counts them)."""
        if len(prompts) * n == 1:  # (no task between the sequence and the request: one less hop a token)
            async for piece in self.sequence(0, prompts[0], kwargs, stops, _seed(seed, 0), arrived, logprobs,
                                             aligned):
                yield piece
            return
        out: "asyncio.Queue[Any]" = asyncio.Queue()
        tasks = []
        for i, ids in enumerate(prompts):
            for j in range(n):
                index = i * n + j
                tasks.append(asyncio.ensure_future(self._pump(index, ids, kwargs, stops, _seed(seed, index), arrived,
                                                              out, logprobs, aligned)))
        try:
            left = len(tasks)
            while left:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish is not None:
                    left -= 1
                yield item
        finally:
            for t in tasks:
                t.cancel()

    async def _pump(self, index: int, ids: List[int], kwargs, stops, seed, arrived: float, out: "asyncio.Queue[Any]",
                    logprobs: Optional[int], aligned: bool):
        try:
            async for piece in self.sequence(index, ids, kwargs, stops, seed, arrived, logprobs, aligned):
                out.put_nowait(piece)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the request's handler answers with it
            out.put_nowait(e)

    async def sequence(self, index: int, ids: List[int], kwargs: Dict[str, Any], stops: Sequence[str],
                       seed: Optional[int], arrived: float, logprobs: Optional[int] = None,
                       aligned: bool = False) -> AsyncIterator[Piece]:
        """One sequence's pieces. Raises what queueing raised (QueueFull, Closed, Unservable for a
        request the batch cannot hold, EngineGone) or what its call failed with."""
        queue: "asyncio.Queue[Any]" = asyncio.Queue()
        self.live.add(queue)
        try:
            feed = _Feed(self._inbox(), queue, logprobs)
            future = await self.engine.queue(ids, kwargs, seed, feed)
        except BaseException:
            self.live.discard(queue)
            raise
        text, stop = Detokenizer(self.tok, ids, self.decode), StopText(stops)
        count, first, last, finish = 0, None, None, None
        try:
            ended = False
            while finish is None and not ended:
                tokens, scores, ended = _taken(queue, await queue.get())
                if not tokens:
                    continue
                last = time.perf_counter()
                first = first if first is not None else last
                # With stop strings, a token at a time: the count stops at the token that ended it;
                # with log-probabilities too: each token's own text.
                step = 1 if stops or scores else len(tokens)
                for at in range(0, len(tokens), step):
                    some = tokens[at:at + step]
                    count += len(some)
                    added, scored = self._added(text, some, scores[at:at + step], aligned)
                    piece, hit = stop.feed(added)
                    if piece or scored:
                        yield Piece(index, piece, logprobs=scored, made=count)
                    if hit:
                        finish = "stop"
                        break
            if finish is None:
                result = await asyncio.wrap_future(future)  # the call's error, if it failed
                count = result.count
                on_eos = count > 0 and result.last in (kwargs.get("eos_token_id") or [])
                finish = "stop" if on_eos else "length"
                tail = stop.flush(text.flush())
                finish = "stop" if stop.stopped else finish
            else:
                tail = ""
            self._count(count, first, last, arrived)
            yield Piece(index, tail, finish, count, made=count, cached=feed.hits)
        finally:
            self.live.discard(queue)
            if not future.done():
                future.cancel()  # a stop string, a client gone: its row is freed at the next step

    def _added(self, text: Detokenizer, tokens: List[int], scores: List[Any],
               aligned: bool) -> Tuple[str, Optional[List[TokenLogprob]]]:
        """The text ``tokens`` add, and their log-probabilities where asked (``scores``: then one
        token): named by each token's own text, or (``aligned``) by the text it adds, the
        alternatives by the text each would have added in its place."""
        if not scores:
            return text.add(tokens), None
        if not aligned:
            return text.add(tokens), self._scored(tokens, scores)
        x = scores[0]
        lp, top = x.unpack() if isinstance(x, Logprobs) else x
        alternatives = [(text.would_add(i), v) for i, v in top]
        added = text.add(tokens)
        return added, [TokenLogprob(added, lp, alternatives)]

    def _scored(self, tokens: List[int], scores: List[Any]) -> List[TokenLogprob]:
        """The API's form of each token's log-probabilities (packed as the engine process sends
        them, or unpacked as the batch in this process gives them): texts for the ids."""
        text = self._text
        out = []
        for t, x in zip(tokens, scores):
            lp, top = x.unpack() if isinstance(x, Logprobs) else x
            out.append(TokenLogprob(text(t), lp, [(text(i), v) for i, v in top]))
        return out

    def _text(self, token: int) -> str:
        """A token's own text, as the API reports it beside its log-probability (cached)."""
        got = self.texts.get(token)
        if got is None:
            got = self.texts[token] = self.tok.decode([token], skip_special_tokens=False)
        return got

    def _count(self, count: int, first: Optional[float], last: Optional[float], arrived: float):
        m = self.metrics
        m.generation_tokens.inc(count)
        if first is not None and last is not None:
            m.ttft.observe(first - arrived)
            m.e2e.observe(last - arrived)
            if count > 1:
                m.tpot.observe((last - first) / (count - 1))

    def _inbox(self) -> _Inbox:
        loop = asyncio.get_running_loop()
        inbox = self.inboxes.get(loop)
        if inbox is None:
            inbox = self.inboxes[loop] = _Inbox(loop)
        return inbox
