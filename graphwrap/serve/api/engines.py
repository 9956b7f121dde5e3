"""What the HTTP app generates with: the shared decode batch in this process (:class:`Local`),
or in a process of its own (:class:`~.remote.Remote`, what ``python -m graphwrap serve`` runs).

Both take a sequence as token ids and ``generate``'s keywords and hand its new tokens to a
:class:`Feed` as they come; both answer with a future that ends in :class:`Ended` (or the
call's error) and whose ``cancel()`` frees the sequence's row at the batch's next step.
"""

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol

import torch

from ...decoding.callers import front
from ...decoding.callers.calls import Closed, QueueFull
from ...errors import GraphwrapError

SUBMITTERS = 8  # threads that queue calls (a call the batch cannot serve runs whole in one)


class Unservable(GraphwrapError):
    """A request the batch cannot take as it is (the client's to change)."""


class EngineGone(GraphwrapError):
    """The process that generates ended: no request can be served (the server must be restarted)."""


class Failed(RuntimeError):
    """A sequence's call failed in the engine's process; ``kind`` names what it raised there."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Ended:
    """How a sequence ended: its new tokens' count and the last token (-1 where none)."""

    count: int
    last: int


class Feed(Protocol):
    """Where a sequence's tokens go. A feed with a ``logprobs`` attribute other than None (k)
    asks for each token's log-probability and the step's k most likely tokens: ``add`` then gets
    them beside the tokens, one ``(log-probability, [(id, log-probability), ...])`` each."""

    def add(self, tokens: List[int], logprobs: Optional[List[Any]] = None) -> None: ...  # new tokens, in order
    def end(self) -> None: ...  # no more tokens (always called, however the sequence ends)


@dataclass(frozen=True)
class ModelInfo:
    """What requests are set against: the model's end-of-sequence ids and the sampling settings
    of its generation config (what a request leaves out)."""

    eos: List[int]
    generation: Any  # an object with do_sample, temperature, top_p, top_k (or None)
    vocab: Optional[int] = None  # token ids the model takes (its input embedding's rows), where it says


def model_vocab(model) -> Optional[int]:
    """How many token ids ``model`` takes: its input embedding's rows (else its config's vocab_size)."""
    embed = getattr(model, "get_input_embeddings", None)
    rows = getattr(embed() if callable(embed) else None, "num_embeddings", None)
    if isinstance(rows, int):
        return rows
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def model_eos(model) -> List[int]:
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def error_kind(e: BaseException) -> str:
    """How an error at queueing crosses to the HTTP side (:func:`queue_error` makes it again)."""
    if isinstance(e, QueueFull):
        return "queue_full"
    if isinstance(e, Closed):
        return "closed"
    if isinstance(e, GraphwrapError):  # the request itself: too long for the cache, ids past the vocabulary
        return "unservable"
    return type(e).__name__


def queue_error(kind: str, message: str) -> BaseException:
    return {"queue_full": QueueFull, "closed": Closed, "unservable": Unservable,
            "gone": EngineGone}.get(kind, lambda m: Failed(kind, m))(message)


def batch_stats(gm) -> dict:
    """``gm.stats()``, with the bytes torch's allocator has handed out on the batch's GPU."""
    stats = gm.stats()
    device = (stats.get("decode") or {}).get("device")
    if isinstance(device, str) and device.startswith("cuda"):
        stats["gpu_memory_allocated"] = torch.cuda.memory_allocated(device)
    return stats


class _Streamer:
    """``generate``'s streamer onto a :class:`Feed` (the prompt, which comes first, left out).
    A feed with a ``sink`` and a ``key`` (the engine process's) lends them to the shared batch,
    which then hands the sink each turn's tokens at once (:class:`~graphwrap.decoding.callers.calls.Sinks`)."""

    __slots__ = ("feed", "prompt", "sink", "key", "logprobs")

    def __init__(self, feed: Feed):
        self.feed, self.prompt = feed, True
        self.sink, self.key = getattr(feed, "sink", None), getattr(feed, "key", None)
        self.logprobs = getattr(feed, "logprobs", None)  # (the batch reads it: settings.plan_call)

    def put(self, value: torch.Tensor):
        if self.prompt:
            self.prompt = False
            return
        self.feed.add(value.reshape(-1).tolist())

    def put_ids(self, ids: List[int], logprobs: Optional[List[Any]] = None):  # (the shared batch's: calls.put_token)
        self.feed.add(ids) if logprobs is None else self.feed.add(ids, logprobs)

    def end(self):
        self.feed.end()

    def put_cached(self, n: int):  # (the shared batch's, with prefix caching: prompt tokens found cached)
        cached = getattr(self.feed, "cached", None)
        if cached is not None:
            cached(n)


def submit(gm, ids: List[int], kwargs: Dict[str, Any], seed: Optional[int], feed: Feed,
           tokenizer: Any = None) -> concurrent.futures.Future:
    """One sequence queued on ``gm``'s batch (blocks while the batch is made, on its first call):
    a future of its :class:`Ended`. Raises QueueFull, Closed, or Unservable. ``tokenizer``: the
    model's, for a request's grammar (compiled here, against it)."""
    prompt = torch.tensor([ids], dtype=torch.long)
    if kwargs.get("grammar") is not None:
        kwargs = dict(kwargs, tokenizer=tokenizer)
    # Every id of a request's prompt is a token: a pad id in it is one too (without a mask, generate
    # takes the pad id for padding, dropping a leading one and sending any other to its own loop).
    try:
        inner = front.submit(gm, (prompt,), dict(kwargs, attention_mask=torch.ones_like(prompt),
                                                  streamer=_Streamer(feed)), False, seed)
    except (QueueFull, Closed):
        raise
    except GraphwrapError as e:
        raise Unservable(str(e)) from e
    out: concurrent.futures.Future = concurrent.futures.Future()

    def done(f):
        if f.cancelled():
            out.cancel()
        elif f.exception() is not None:
            out.set_exception(f.exception())
        elif not out.done():
            t = f.result()
            count = t.shape[1] - len(ids)
            out.set_result(Ended(count, int(t[0, -1]) if count > 0 else -1))

    inner.add_done_callback(done)
    out.add_done_callback(lambda o: inner.cancel() if o.cancelled() else None)
    return out


class Local:
    """The batch of a GraphedModule in this process (tests, embedding, a Ray Serve replica): the
    server's Python per token shares the interpreter with the decode thread."""

    def __init__(self, gm, tokenizer: Any = None):
        self.gm, self.tokenizer = gm, tokenizer
        self.pool = concurrent.futures.ThreadPoolExecutor(SUBMITTERS, thread_name_prefix="graphwrap-submit")

    @property
    def info(self) -> ModelInfo:  # (read each time: the model may change behind the server)
        m = self.gm.module
        return ModelInfo(model_eos(m), getattr(m, "generation_config", None), model_vocab(m))

    def gone(self) -> Optional[str]:
        return None

    async def queue(self, ids: List[int], kwargs: Dict[str, Any], seed: Optional[int],
                    feed: Feed) -> concurrent.futures.Future:
        """The sequence queued (in a thread: making the batch, on the first call, takes a
        while). A task cancelled meanwhile cancels the sequence once it is queued."""
        loop = asyncio.get_running_loop()
        queued = loop.run_in_executor(self.pool, submit, self.gm, ids, kwargs, seed, feed, self.tokenizer)
        try:
            return await asyncio.shield(queued)
        except asyncio.CancelledError:
            queued.add_done_callback(lambda f: f.result().cancel() if not f.cancelled() and f.exception() is None
                                     else None)
            raise

    def stats(self) -> dict:
        return batch_stats(self.gm)

    def close(self, cancel: bool = True, timeout: Optional[float] = None) -> bool:
        done = self.gm.close(cancel=cancel, timeout=timeout)
        self.pool.shutdown(wait=False, cancel_futures=True)
        return done
