"""Several engine processes behind one server: ``python -m graphwrap serve --data-parallel N``.

Each engine process holds the model and a shared decode batch on a GPU of its own (engine ``i``
sees only the ``i``-th GPU, as ``cuda``), or all on the CPU with ``--device cpu``; they start as
one engine does (:class:`~.remote.Remote`), all at once. :class:`Routed` stands where one engine
stands, so the HTTP app does not know how many there are:

- **Routing.** A sequence goes to the engine that was given a prompt starting alike, where its
  prefix cache may still hold those blocks, else to the one with the fewest sequences in flight
  (``--routing prefix``, the default: :class:`~graphwrap.serve.routing.PrefixRouter`, which
  ``Replicas`` uses too). ``--routing load`` always takes the least loaded (what prefix routing
  is measured against).
- **An engine that dies** fails its own sequences in flight (``EngineGone``, as with one engine);
  new sequences go to the engines left (as do those an engine refuses with a full queue), and
  ``/health`` says which failed. Only when every engine is gone is every request refused (503).
- **Counts.** ``stats()`` has each engine's own (``engines``, in order) and how sequences were
  routed; ``/metrics`` labels each engine's figures ``engine="i"``.
"""
import argparse
import concurrent.futures
import copy
import itertools
import logging
import os
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from ...errors import GraphwrapError
from ..routing import PrefixRouter
from .engines import EngineGone, Feed, QueueFull

logger = logging.getLogger("graphwrap.serve")
ROUTINGS = ("prefix", "load")


def refused(a: argparse.Namespace) -> Optional[str]:
    """Why ``--data-parallel`` cannot be as asked (None where it can)."""
    n = getattr(a, "data_parallel", 1)
    if n < 1:
        return f"--data-parallel must be at least 1, got {n}"
    if n == 1:
        return None
    if a.engine != "process":
        return "--data-parallel above 1 needs --engine process (each engine is a process of its own)"
    if a.device not in (None, "cuda", "cpu"):
        return (f"--data-parallel gives engine i the i-th GPU: leave --device out, or set it to cuda or cpu, "
                f"not {a.device}")
    return None


def engine_args(a: argparse.Namespace, gpus: int, env: Mapping[str, str]) -> List[argparse.Namespace]:
    """Each engine process's arguments, given the ``gpus`` this process sees and its environment:
    where the engines run on GPUs (``--device cuda``, or no ``--device`` and a GPU here), engine
    ``i`` sees only the ``i``-th (its ``CUDA_VISIBLE_DEVICES``, :func:`~.engine_process.run`),
    so that every thread of its process works on that GPU as ``cuda``. GraphwrapError where there
    are fewer GPUs than engines."""
    n = a.data_parallel
    on_gpus = a.device == "cuda" or (a.device is None and gpus > 0)
    if on_gpus and gpus < n:
        raise GraphwrapError(f"--data-parallel {n} puts an engine on each of {n} GPUs: this machine shows {gpus}"
                             " (--device cpu runs them all on the CPU)")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in visible.split(",") if x.strip()] if visible is not None else [str(i) for i in range(n)]
    out = []
    for i in range(n):
        mine = copy.copy(a)
        mine.device = "cuda" if on_gpus else "cpu"
        mine.cuda_visible = ids[i] if on_gpus else None
        mine.engine_index = i
        out.append(mine)
    return out


def start(a: argparse.Namespace, make: Callable[[argparse.Namespace], Any]) -> "Routed":
    """``a.data_parallel`` engines made at once by ``make`` (each from :func:`engine_args`); if
    one fails, those made are closed and its error raised."""
    args = engine_args(a, _gpus() if a.device != "cpu" else 0, os.environ)
    with concurrent.futures.ThreadPoolExecutor(len(args), thread_name_prefix="graphwrap-engine-start") as pool:
        futures = [pool.submit(make, mine) for mine in args]
        concurrent.futures.wait(futures)
    made = [f.result() for f in futures if f.exception() is None]
    failed = [e for e in (f.exception() for f in futures) if e is not None]
    if failed:
        for engine in made:
            engine.close(cancel=True, timeout=5)
        raise failed[0]
    logger.info("%d engine processes on %s", len(made), ", ".join(
        "the CPU" if m.device == "cpu" else f"GPU {m.cuda_visible}" for m in args))
    return Routed(made, getattr(a, "routing", "prefix"))


def _gpus() -> int:
    """The CUDA devices this process sees (the count only: no context is made here)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class Routed:
    """Engines (each a :class:`~.remote.Remote` or :class:`~.local.Local`) behind the app, each
    sequence queued on the one that ``routing`` picks."""

    def __init__(self, engines: Sequence[Any], routing: str = "prefix"):
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        self.engines = list(engines)
        for e in self.engines:
            e.shared = True  # (an engine that ends says its own sequences fail, not every request)
        self.routing = routing
        self.router = PrefixRouter(len(self.engines))
        self.inflight = [0] * len(self.engines)  # sequences queued on each, not ended
        self.sent = [0] * len(self.engines)  # sequences each was given
        self.lock = threading.Lock()  # guards the router and the counts
        self.turn = itertools.count()
        self.told: set = set()  # engines whose death was logged
        self.info = self.engines[0].info
        self.context: int = min(e.context for e in self.engines)
        fronts = [getattr(e, "fronts", None) for e in self.engines]
        self.fronts: Optional[List[Any]] = fronts if all(f is not None for f in fronts) else None

    def gone(self) -> Optional[str]:
        """Why no engine can serve (None while one can)."""
        why = [e.gone() for e in self.engines]
        return None if any(w is None for w in why) else "every engine process ended: " + "; ".join(map(str, why))

    def failed(self) -> Dict[int, str]:
        """The engines that ended, with why (``/health``)."""
        return {i: w for i, w in enumerate(e.gone() for e in self.engines) if w is not None}

    def pick(self, ids: Sequence[int]) -> int:
        """The engine for a prompt of ``ids`` (counted in flight there). Raises EngineGone where
        none is left."""
        failed = self.failed()
        with self.lock:
            for i in failed.keys() - self.told:
                logger.error("engine %d ended (%s): the others take its share of new requests", i, failed[i])
                self.told.add(i)
            live = [i for i in range(len(self.engines)) if i not in failed]
            if not live:
                raise EngineGone(self.gone() or "every engine process ended")
            start = next(self.turn) % len(self.engines)
            if self.routing == "prefix":
                load = [float("inf") if i in failed else self.inflight[i] for i in range(len(self.engines))]
                best = self.router.pick(ids, load, start)
            else:
                best = min(live, key=lambda i: (self.inflight[i], (i - start) % len(self.engines)))
            self.inflight[best] += 1
            self.sent[best] += 1
            return best

    def _ended(self, i: int):
        with self.lock:
            self.inflight[i] -= 1

    def other(self, tried: set) -> Optional[int]:
        """The least loaded engine left that is not in ``tried`` (counted in flight there), or None."""
        failed = self.failed()
        with self.lock:
            left = [i for i in range(len(self.engines)) if i not in tried and i not in failed]
            if not left:
                return None
            best = min(left, key=lambda i: self.inflight[i])
            self.inflight[best] += 1
            self.sent[best] += 1
            return best

    async def queue(self, ids: List[int], kwargs: Dict[str, Any], seed: Optional[int],
                    feed: Feed) -> concurrent.futures.Future:
        """The sequence queued on the engine :meth:`pick` chooses: its future. Where that engine's
        queue is full, the least loaded of the others is tried, and so on; raises what the last
        one tried raised (as its ``queue`` does). (Not where an engine ended meanwhile: by then
        it may have ended the sequence's feed, which a second engine must not feed again.)"""
        i: Optional[int] = self.pick(ids)
        tried: set = set()
        while True:
            assert i is not None
            tried.add(i)
            try:
                future = await self.engines[i].queue(ids, kwargs, seed, feed)
            except QueueFull:  # (refused before any token: the feed is untouched)
                self._ended(i)
                i = self.other(tried)
                if i is None:
                    raise
                continue
            except BaseException:
                self._ended(i)
                raise
            done = i
            future.add_done_callback(lambda _f: self._ended(done))
            return future

    def stats(self) -> dict:
        """Each engine's ``stats()`` (``{}`` for one that ended), and the routing's counts."""
        with self.lock:
            routed = {"routing": self.routing, "sent": list(self.sent), "inflight": list(self.inflight),
                      "by": dict(self.router.routed)}
        return {"engines": [e.stats() if e.gone() is None else {} for e in self.engines], "routed": routed}

    def close(self, cancel: bool = True, timeout: Optional[float] = None) -> bool:
        """Every engine closed at once; whether each ended within ``timeout``."""
        with concurrent.futures.ThreadPoolExecutor(len(self.engines), thread_name_prefix="graphwrap-engine-close") \
                as pool:
            # (every result read: ``all`` stopping at a first False would cancel the closes not yet started)
            done = list(pool.map(lambda e: e.close(cancel=cancel, timeout=timeout), self.engines))
        return all(done)
