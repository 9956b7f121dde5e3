"""The server's way into the shared decode batch: each sequence a ``generate`` call of the
GraphedModule with a streamer that hands its tokens to the request's own asyncio queue, drained
by the request's task (never by a callback on the batch's thread).

A sequence's tokens become text (:mod:`.text`); a stop string found ends it there and cancels
its call, which frees its row at the batch's next step; a request that goes away (a client that
disconnects, a task cancelled) cancels every call it has, in the ``finally`` of its stream.
"""

import asyncio
import concurrent.futures
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Tuple

import torch

from ...decoding import front
from ...decoding.calls import Closed, QueueFull
from ...errors import GraphwrapError
from .metrics import Metrics
from .text import Detokenizer, StopText

_END = object()


class Unservable(GraphwrapError):
    """A request the batch cannot take as it is (the client's to change)."""

SUBMITTERS = 8  # threads that queue calls (a call the batch cannot serve runs whole in one)


@dataclass(slots=True)
class Piece:
    """Text of one choice: more of it, or its end (``finish`` set, ``tokens`` its count)."""

    index: int
    text: str
    finish: Optional[str] = None  # "stop" or "length" at the end
    tokens: int = 0


def _seed(seed: Optional[int], index: int) -> Optional[int]:
    """Choice ``index``'s seed: its own, and no two requests' seeds give one choice the same."""
    return None if seed is None else (seed * 0x9E3779B1 + index) % (1 << 63)


class _Inbox:
    """Tokens for the sequences of one event loop, handed over in one wake-up of the loop however
    many sequences got tokens meanwhile (a decode step's tokens come one sequence at a time, from
    the batch's delivery workers; a wake-up per token would cost the loop more than the token)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()  # guards items and scheduled
        self.items: List[Tuple["asyncio.Queue[Any]", Any]] = []
        self.scheduled = False

    def post(self, queue: "asyncio.Queue[Any]", item: Any):
        with self.lock:
            self.items.append((queue, item))
            if self.scheduled:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self):
        with self.lock:
            items, self.items, self.scheduled = self.items, [], False
        for queue, item in items:
            queue.put_nowait(item)


class _Feed:
    """A ``generate`` streamer into a sequence's asyncio queue."""

    def __init__(self, inbox: _Inbox, queue: "asyncio.Queue[Any]"):
        self.inbox, self.queue, self.prompt = inbox, queue, True

    def put(self, value: torch.Tensor):
        if self.prompt:  # generate's streamer gets the prompt first
            self.prompt = False
            return
        self.inbox.post(self.queue, value.reshape(-1).tolist())

    def end(self):
        self.inbox.post(self.queue, _END)


class Client:
    """Generation for the HTTP handlers, over one GraphedModule and its tokenizer."""

    def __init__(self, gm, tokenizer, metrics: Metrics):
        self.gm, self.tok, self.metrics = gm, tokenizer, metrics
        self.pool = concurrent.futures.ThreadPoolExecutor(SUBMITTERS, thread_name_prefix="graphwrap-submit")
        self.inboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Inbox]" = weakref.WeakKeyDictionary()

    async def choices(self, prompts: Sequence[List[int]], n: int, kwargs: Dict[str, Any], stops: Sequence[str],
                      seed: Optional[int], arrived: float) -> AsyncIterator[Piece]:
        """Every choice's pieces as they come (choice ``i * n + j`` is prompt ``i``'s ``j``-th),
        each choice's last piece with its finish. Leaving the loop early cancels what is left."""
        if len(prompts) * n == 1:  # (no task between the sequence and the request: one less hop a token)
            async for piece in self.sequence(0, prompts[0], kwargs, stops, _seed(seed, 0), arrived):
                yield piece
            return
        out: "asyncio.Queue[Any]" = asyncio.Queue()
        tasks = []
        for i, ids in enumerate(prompts):
            for j in range(n):
                index = i * n + j
                tasks.append(asyncio.ensure_future(self._pump(index, ids, kwargs, stops, _seed(seed, index), arrived,
                                                              out)))
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

    async def _pump(self, index: int, ids: List[int], kwargs, stops, seed, arrived: float, out: "asyncio.Queue[Any]"):
        try:
            async for piece in self.sequence(index, ids, kwargs, stops, seed, arrived):
                out.put_nowait(piece)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the request's handler answers with it
            out.put_nowait(e)

    async def sequence(self, index: int, ids: List[int], kwargs: Dict[str, Any], stops: Sequence[str],
                       seed: Optional[int], arrived: float) -> AsyncIterator[Piece]:
        """One sequence's pieces. Raises what queueing raised (QueueFull, GraphwrapError for a
        request the batch cannot hold) or what its call failed with."""
        queue: "asyncio.Queue[Any]" = asyncio.Queue()
        call = dict(kwargs, streamer=_Feed(self._inbox(), queue))
        prompt = torch.tensor([ids], dtype=torch.long)
        future = await self._submit(prompt, call, seed)
        text, stop = Detokenizer(self.tok, ids), StopText(stops)
        count, first, last, finish = 0, None, None, None
        try:
            ended = False
            while finish is None and not ended:
                got = await queue.get()
                tokens: List[int] = []
                while got is not _END:  # every token come meanwhile: one piece for them all
                    tokens += got
                    if queue.empty():
                        break
                    got = queue.get_nowait()
                ended = got is _END
                if not tokens:
                    continue
                last = time.perf_counter()
                first = first if first is not None else last
                # With stop strings, a token at a time: the count stops at the token that ended it.
                for some in ([[t] for t in tokens] if stops else [tokens]):
                    count += len(some)
                    piece, hit = stop.feed(text.add(some))
                    if piece:
                        yield Piece(index, piece)
                    if hit:
                        finish = "stop"
                        break
            if finish is None:
                out = await asyncio.wrap_future(future)  # the call's error, if it failed
                count = out.shape[1] - len(ids)
                on_eos = count > 0 and int(out[0, -1]) in (kwargs.get("eos_token_id") or [])
                finish = "stop" if on_eos else "length"
                tail = stop.flush(text.flush())
                finish = "stop" if stop.stopped else finish
            else:
                tail = ""
            self._count(count, first, last, arrived)
            yield Piece(index, tail, finish, count)
        finally:
            if not future.done():
                future.cancel()  # a stop string, a client gone: its row is freed at the next step

    async def _submit(self, prompt: torch.Tensor, call: Dict[str, Any], seed: Optional[int]):
        """The call queued on the batch (its future), in a thread: making the batch, on the
        first call, takes a while. A task cancelled meanwhile cancels the call once queued."""
        loop = asyncio.get_running_loop()
        queued = loop.run_in_executor(self.pool, lambda: front.submit(self.gm, (prompt,), call, False, seed))
        try:
            return await asyncio.shield(queued)
        except asyncio.CancelledError:
            queued.add_done_callback(lambda f: f.result().cancel() if not f.cancelled() and f.exception() is None
                                     else None)
            raise
        except (QueueFull, Closed):
            raise
        except GraphwrapError as e:  # the request itself: too long for the cache, ids past the vocabulary
            raise Unservable(str(e)) from e

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

    def close(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
