"""Every GPU of a host: one GraphedModule and one Batcher per device, requests spread over them.

Each replica has its own copy of the model, its own graphs, graph pool and streams on its
device, and its own :class:`graphwrap.Batcher`. A request goes to the replica with the fewest
requests in flight (ties: the next one in turn), its inputs stay where they are (host inputs
are copied to that device by the replica, device inputs on another GPU are moved there), and
its outputs are on that replica's device.
"""

import concurrent.futures
import copy
import itertools
import threading
from typing import Any, Callable, List, Optional, Sequence, Union

import torch
from torch import nn

from ..core.tree import map_tensors
from ..errors import GraphwrapError
from ..loops.batcher import Batcher
from ..module import GraphedModule, options_of
from .routing import PrefixRouter

ROUTINGS = ("prefix", "load")


class _Replica:
    __slots__ = ("device", "gm", "batcher", "inflight")

    def __init__(self, device, gm, batcher):
        self.device, self.gm, self.batcher = device, gm, batcher
        self.inflight = 0


class Replicas:
    """One :class:`GraphedModule` with a :class:`Batcher` per device, served as one.

    Args:
        model: an ``nn.Module`` (copied to each device) or a callable ``factory(device)`` that
            returns the module for a device (to build each copy in place, or load weights there).
        devices: the devices (default: every CUDA device; the CPU where there is none).
        batcher: keyword arguments of each :class:`Batcher` (``max_delay_ms``, ...).
        routing: where ``generate`` calls go: ``"prefix"`` (the default, below) or ``"load"``
            (always the least loaded).
        **graphed: keyword arguments of each :class:`GraphedModule` (``compile``, ...).

    ``replicas(*args, **kwargs)``, ``submit(...)`` and ``await acall(...)`` are the Batcher's
    calls, on the replica with the fewest requests in flight. ``generate`` and
    ``submit_generate`` go to the replica that served a prompt starting alike, where its prefix
    cache may hold it (:mod:`.routing`), else to the least loaded (``routing="prefix"``).
    """

    def __init__(self, model: Union[nn.Module, Callable[[torch.device], nn.Module]],
                 devices: Optional[Sequence[Union[str, torch.device]]] = None, *, batcher: Optional[dict] = None,
                 routing: str = "prefix", **graphed: Any) -> None:
        if routing not in ROUTINGS:
            raise GraphwrapError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        if devices is None:
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            devices = [f"cuda:{i}" for i in range(n)] or ["cpu"]
        devices = _devices(devices)
        if not devices:
            raise GraphwrapError("Replicas needs at least one device")
        if len(set(devices)) != len(devices):
            raise GraphwrapError(f"devices must differ, got {[str(d) for d in devices]}")
        if isinstance(model, GraphedModule):
            # A GraphedModule given: its module is copied, and its options are the default ones.
            graphed = {**options_of(model), **graphed}
            model = model.module
        self._replicas: List[_Replica] = []
        for d in devices:
            if isinstance(model, nn.Module):
                m = copy.deepcopy(model).to(d)
            elif callable(model):
                m = model(d)
                if not isinstance(m, nn.Module):
                    raise GraphwrapError(f"the factory returned {type(m).__name__} for {d}, not an nn.Module")
            else:
                raise GraphwrapError(f"Replicas takes an nn.Module or a factory(device), got {type(model).__name__}")
            gm = GraphedModule(m, **graphed)
            self._replicas.append(_Replica(d, gm, Batcher(gm, **(batcher or {}))))
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self._router = PrefixRouter(len(self._replicas))  # (generate calls: routing.py)
        self.routing = routing
        self._closed = False

    @property
    def devices(self) -> List[torch.device]:
        return [r.device for r in self._replicas]

    @property
    def modules(self) -> List[GraphedModule]:
        return [r.gm for r in self._replicas]

    def _pick(self) -> _Replica:
        with self._lock:
            if self._closed:
                raise GraphwrapError("these Replicas are closed: make new ones to serve more requests")
            r = self._replicas[self._least()]
            r.inflight += 1
            return r

    def _least(self, start: Optional[int] = None) -> int:
        """The replica with the fewest calls in flight (ties: the next in turn). Under the lock."""
        reps = self._replicas
        start = next(self._turn) % len(reps) if start is None else start
        return min(range(len(reps)), key=lambda i: (reps[i].inflight, (i - start) % len(reps)))

    def _done(self, r: _Replica):
        with self._lock:
            r.inflight -= 1

    @staticmethod
    def _moved(r: _Replica, args, kwargs):
        dev = r.device
        if dev.type != "cuda":
            return args, kwargs
        return map_tensors(lambda t: t.to(dev) if t.is_cuda and t.device != dev else t, (args, kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        r = self._pick()
        try:
            args, kwargs = self._moved(r, args, kwargs)
            return r.batcher(*args, **kwargs)
        finally:
            self._done(r)

    def submit(self, *args: Any, **kwargs: Any) -> "concurrent.futures.Future[Any]":
        r = self._pick()
        try:
            args, kwargs = self._moved(r, args, kwargs)
            fut = r.batcher.submit(*args, **kwargs)
        except BaseException:
            self._done(r)
            raise
        fut.add_done_callback(lambda _f: self._done(r))
        return fut

    async def acall(self, *args: Any, **kwargs: Any) -> Any:
        r = self._pick()
        try:
            args, kwargs = self._moved(r, args, kwargs)
            return await r.batcher.acall(*args, **kwargs)
        finally:
            self._done(r)

    def submit_generate(self, input_ids: torch.Tensor, **kwargs: Any) -> "concurrent.futures.Future[Any]":
        """``submit_generate`` on the replica that served a prompt starting alike (its first row's
        leading blocks, :mod:`.routing`), else on the one with the fewest calls in flight; the
        output is on that replica's device."""
        r = self._pick_for(input_ids)
        try:
            ids, kwargs = self._moved(r, (input_ids,), kwargs)
            fut = r.gm.submit_generate(ids[0].to(r.device), **kwargs)
        except BaseException:
            self._done(r)
            raise
        fut.add_done_callback(lambda _f: self._done(r))
        return fut

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``generate``, routed as :meth:`submit_generate` routes."""
        return self.submit_generate(input_ids, **kwargs).result()

    def _pick_for(self, input_ids: torch.Tensor) -> _Replica:
        tokens = input_ids[0].tolist() if input_ids.dim() == 2 else input_ids.tolist()
        with self._lock:
            if self._closed:
                raise GraphwrapError("these Replicas are closed: make new ones to serve more requests")
            reps = self._replicas
            start = next(self._turn) % len(reps)
            if self.routing == "prefix":
                r = reps[self._router.pick(tokens, [x.inflight for x in reps], start)]
            else:
                r = reps[self._least(start)]
                self._router.routed["load"] += 1
            r.inflight += 1
            return r

    def capture(self, *args: Any, **kwargs: Any) -> List[dict]:
        """``capture`` on every replica (each with the sample moved to its device)."""
        out = []
        for r in self._replicas:
            a, k = map_tensors(lambda t: t.to(r.device), (args, kwargs))
            out.append(r.gm.capture(*a, **k))
        return out

    def stats(self) -> dict:
        """Per device: the Batcher's stats, the GraphedModule's, and the requests in flight."""
        return {str(r.device): {"batcher": r.batcher.stats(), "graphs": r.gm.stats(), "inflight": r.inflight}
                for r in self._replicas}

    @property
    def routed(self) -> dict:
        """generate calls routed so far: ``prefix`` (to a replica that matched their prompt's
        leading blocks) and ``load`` (to the least loaded)."""
        with self._lock:
            return dict(self._router.routed)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for r in self._replicas:
            r.batcher.close()

    def __enter__(self) -> "Replicas":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self):
        return f"Replicas(devices={[str(d) for d in self.devices]})"


def _devices(given) -> List[torch.device]:
    """``devices=`` as torch devices; GraphwrapError for a string, a bad name, or a CUDA device
    this process does not have."""
    if isinstance(given, (str, torch.device)) or not hasattr(given, "__iter__"):
        raise GraphwrapError(f"devices must be a list of devices, such as [\"cuda:0\", \"cuda:1\"], got {given!r}")
    out = []
    for d in given:
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError) as e:
            raise GraphwrapError(f"devices: {d!r} is not a device ({e})") from None
        if dev.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if (dev.index or 0) >= count:
                raise GraphwrapError(f"devices: {dev} is not here (this process sees {count} CUDA devices)")
        out.append(dev)
    return out
