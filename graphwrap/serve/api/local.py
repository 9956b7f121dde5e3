"""The shared decode batch of a GraphedModule in this process, as the HTTP app generates with it
(:class:`Local`: tests, a Ray Serve replica, ``serve --engine thread``), and the submission of
one sequence that the engine process makes too (:func:`submit`)."""

import asyncio
import concurrent.futures
from typing import Any, Dict, List, Optional

import torch

from ...decoding.callers import front
from ...decoding.callers.errors import Closed, QueueFull
from ...errors import GraphwrapError
from .engines import SUBMITTERS, Ended, Feed, ModelInfo, Unservable, model_eos, model_vocab


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
