"""The OpenAI app on Ray Serve with its replicas chosen by prompt: two deployments, where
``generation_deployment(..., routing="prefix")`` asks for more than one replica.

Ray's HTTP proxy picks a replica before the request's body is read, so it cannot see a prompt.
Here the ingress (the app, on the CPU) reads and tokenizes each request, then queues each
sequence on the engine deployment through its handle: each engine replica holds the model and a
shared decode batch on a GPU of its own, and streams a sequence's tokens back. The handle picks
the engine replica with :class:`PrefixRequestRouter` (Ray's request-router interface, Ray 2.46
or later): the replica that was given a prompt starting alike, whose prefix cache may still hold
it, by the rules of :func:`graphwrap.serve.routing.choose` over Ray's cached queue lengths; else
Ray's own choice among them all (the least loaded of those it probes). Ray is imported here only.

What crosses from an engine replica, in order: ``("q", error, replica)`` once the sequence is
queued (error None) or refused (``(kind, message)``, nothing follows); ``("t", tokens,
logprobs)`` as tokens come; ``("c", n)`` the prompt tokens found cached; last ``("e", count,
last, error)``.
"""

import asyncio
import collections
import concurrent.futures
import logging
from typing import Any, Dict, List, Optional

from ..routing import BALANCE, REMEMBERED, SHARE, SLACK, block_hashes, choose, remember
from .engines import Ended, Feed, ModelInfo, error_kind, queue_error
from .local import batch_stats

logger = logging.getLogger("graphwrap.serve")
_END = object()


try:  # (Ray 2.46 or later; Ray finds the class by its module's name, so it is defined at the top)
    from ray.serve.request_router import RequestRouter as _RequestRouter
except ImportError:  # (an older Ray: its own routing, with a warning)
    _RequestRouter = None

if _RequestRouter is not None:
    class PrefixRequestRouter(_RequestRouter):
        """An engine replica for each handle call of ``generate(ids, ...)``: the one given a
        prompt that starts alike (``routing.choose``, with the loads Ray's cache of queue lengths
        knows), else all of them for Ray to choose among."""

        def initialize_state(self, slack: float = SLACK, balance: float = BALANCE, share: float = SHARE,
                             remembered: int = REMEMBERED, **kwargs):
            self.seen: Dict[Any, Any] = {}  # replica id -> the block hashes it was given
            self.slack, self.balance, self.share, self.remembered = slack, balance, share, remembered

        async def choose_replicas(self, candidate_replicas, pending_request=None):
            hashes = _hashes(pending_request)
            if not hashes or len(candidate_replicas) < 2:
                return [candidate_replicas]
            cache = self.replica_queue_len_cache
            load = [cache.get(r.replica_id) or 0 for r in candidate_replicas]
            seen = [self.seen.get(r.replica_id) for r in candidate_replicas]
            i = choose(hashes, seen, load, self.slack, self.balance, self.share)
            if i is None:
                return [candidate_replicas]
            best = candidate_replicas[i]
            return [[best], [r for r in candidate_replicas if r is not best]]

        def on_request_routed(self, pending_request, replica_id, result):
            hashes = _hashes(pending_request)
            if hashes:
                remember(self.seen.setdefault(replica_id, collections.OrderedDict()), hashes, self.remembered)

        def on_replica_actor_died(self, replica_id):
            self.seen.pop(replica_id, None)
            super().on_replica_actor_died(replica_id)


def router_class() -> Optional[type]:
    """:class:`PrefixRequestRouter` where this Ray has the request-router interface, else None."""
    return PrefixRequestRouter if _RequestRouter is not None else None


def _hashes(pending_request) -> List[int]:
    """The block hashes of a ``generate`` call's prompt (its first argument), or none."""
    args = getattr(pending_request, "args", None) if pending_request is not None else None
    ids = args[0] if args else None
    return block_hashes(ids) if isinstance(ids, list) and ids and isinstance(ids[0], int) else []


class EngineReplica:
    """One engine replica: the model and its shared batch, loaded as ``python -m graphwrap serve
    ARGV`` loads them (in this process)."""

    def __init__(self, argv: List[str]):
        from .cli import parser
        from .loading import load_here

        self.served = load_here(parser().parse_args(argv))
        self.local = self.served.engine
        try:
            from ray import serve

            ctx = serve.get_replica_context()
            self.name = str(getattr(getattr(ctx, "replica_id", None), "unique_id", None) or ctx.replica_tag)
        except Exception:  # noqa: BLE001 - outside a replica (a test): a name of its own
            self.name = str(id(self))

    def describe(self) -> Dict[str, Any]:
        """What the app sets requests against: the model's eos ids, its sampling defaults, its
        vocabulary and the context."""
        from .engine_process import sampling_of

        info = self.local.info
        return {"eos": info.eos, "generation": sampling_of(self.local.gm.module), "vocab": info.vocab,
                "context": self.served.context}

    def stats(self) -> dict:
        return batch_stats(self.local.gm)

    async def generate(self, ids: List[int], kwargs: Dict[str, Any], seed: Optional[int], logprobs: Optional[int]):
        """One sequence: its messages (the module's docstring), streamed."""
        loop = asyncio.get_running_loop()
        queue: "asyncio.Queue[Any]" = asyncio.Queue()
        feed = _QueueFeed(loop, queue, logprobs)
        try:
            future = await self.local.queue(ids, kwargs, seed, feed)
        except Exception as e:  # noqa: BLE001 - the request's: told to the ingress
            yield ("q", (error_kind(e), str(e)), self.name)
            return
        yield ("q", None, self.name)
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    break
                yield item
            try:
                ended = await asyncio.wrap_future(future)
            except Exception as e:  # noqa: BLE001 - the call's failure: told to the ingress
                yield ("e", 0, -1, (type(e).__name__, str(e)))
                return
            yield ("e", ended.count, ended.last, None)
        finally:
            if not future.done():  # (the ingress cancelled it: its client went away)
                future.cancel()


class _QueueFeed:
    """A sequence's tokens into an asyncio queue, from the batch's threads."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: "asyncio.Queue[Any]", logprobs: Optional[int]):
        self.loop, self.queue, self.logprobs = loop, queue, logprobs

    def add(self, tokens: List[int], logprobs: Optional[List[Any]] = None):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("t", tokens, logprobs))

    def end(self):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, _END)

    def cached(self, n: int):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("c", n))


class RayEngines:
    """The ingress's engine (what :class:`~.app.Served` generates with): each sequence a streamed
    call of the engine deployment's ``generate``, on the replica its router picks."""

    def __init__(self, handle):
        self.handle = handle
        self.info = ModelInfo([], None, None)  # (the engine's, once :meth:`start` has asked)
        self.context = 0
        self.fronts = None
        self.sent: Dict[str, int] = {}  # sequences each engine replica took, by its name

    async def start(self):
        """The model's facts, from an engine replica (the app's start, before any request)."""
        described = await self.handle.describe.remote()
        self.info = ModelInfo(described["eos"], described["generation"], described["vocab"])
        self.context = described["context"]

    def gone(self) -> Optional[str]:
        return None

    async def queue(self, ids: List[int], kwargs: Dict[str, Any], seed: Optional[int],
                    feed: Feed) -> concurrent.futures.Future:
        stream = self.handle.options(stream=True).generate.remote(ids, kwargs, seed, getattr(feed, "logprobs", None))
        try:
            first = await stream.__anext__()
        except asyncio.CancelledError:  # (its client went away while it was queued)
            stream.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - no engine replica took it (one died, Ray failed the call): 503
            raise queue_error("gone", f"no engine replica took the sequence: {type(e).__name__}: {e}") from e
        if first[1] is not None:
            raise queue_error(*first[1])
        self.sent[first[2]] = self.sent.get(first[2], 0) + 1
        out: concurrent.futures.Future = concurrent.futures.Future()
        task = asyncio.get_running_loop().create_task(_pump(stream, feed, out))
        out.add_done_callback(lambda f: (task.cancel(), stream.cancel()) if f.cancelled() else None)
        return out

    def stats(self) -> dict:
        return {"routed": {"sent": list(self.sent.values())}}

    def close(self, cancel: bool = True, timeout: Optional[float] = None) -> bool:
        return True


async def _pump(stream, feed: Feed, out: concurrent.futures.Future):
    """A sequence's tokens from its engine replica into its feed, then its end into ``out``."""
    try:
        async for item in stream:
            if item[0] == "t":
                feed.add(item[1]) if item[2] is None else feed.add(item[1], item[2])
            elif item[0] == "c":
                cached = getattr(feed, "cached", None)
                if cached is not None:
                    cached(item[1])
            elif item[0] == "e":
                feed.end()
                _settle(out, Ended(item[1], item[2]) if item[3] is None else queue_error(*item[3]))
                return
        feed.end()
        _settle(out, queue_error("gone", "the engine replica's stream ended without the sequence's end"))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the replica died or Ray failed the call: the sequence fails with it
        feed.end()
        _settle(out, queue_error("gone", f"the engine replica failed: {type(e).__name__}: {e}"))


def _settle(fut: concurrent.futures.Future, value: Any):
    try:
        fut.set_exception(value) if isinstance(value, BaseException) else fut.set_result(value)
    except concurrent.futures.InvalidStateError:  # cancelled meanwhile
        pass


def deployments(model: str, argv: List[str], num_replicas: int, actor: Dict[str, Any], name: str,
                **deployment_options):
    """The two deployments, bound: the ingress (the app, one CPU) over ``num_replicas`` engine
    replicas (``actor``: each one's Ray options) routed by :class:`PrefixRequestRouter`."""
    from ray import serve

    engine_name = f"{name}-engine"
    router = router_class()
    options = dict(deployment_options)
    if router is not None:
        from ray.serve.config import RequestRouterConfig

        options["request_router_config"] = RequestRouterConfig(request_router_class=router)
    else:
        logger.warning("this Ray (before 2.46) has no request routers: the engine replicas are chosen by Ray, "
                       "not by prompt")
    engines = serve.deployment(EngineReplica, name=engine_name, num_replicas=num_replicas, ray_actor_options=actor,
                               **options).bind(argv)

    def build():  # in the ingress's replica, as it starts (its engine's facts come at the app's start)
        from transformers import AutoTokenizer

        from .app import MAX_NEW_DEFAULT, Served, make_app
        from .cli import parser
        from .loading import limits

        a = parser().parse_args(argv)
        handle = serve.get_deployment_handle(engine_name, app_name=serve.get_replica_context().app_name)
        tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
        served = Served(RayEngines(handle), tok, a.served_model_name or model, 0,
                        a.max_tokens_default or MAX_NEW_DEFAULT)
        return make_app(limits(a, served))

    ingress = serve.ingress(build)()
    return serve.deployment(ingress, name=name, num_replicas=1, ray_actor_options={"num_cpus": 1},
                            max_ongoing_requests=deployment_options.get("max_ongoing_requests", 1024)).bind(engines)
