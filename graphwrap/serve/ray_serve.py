"""Ray Serve: a deployment that serves a model through graphwrap on each replica's GPU.

``pip install "graphwrap[serve]"`` (or ``pip install "ray[serve]"``); Ray is imported here only,
when :func:`deployment` is called.

Ray Serve routes requests to replicas, scales them and restarts them; each replica builds the
model on its GPU, wraps it in a :class:`graphwrap.GraphedModule`, captures every bucket when it
starts (with ``sample``), so the first request is fast, and joins the requests it receives in
a :class:`graphwrap.Batcher` on its event loop. Ray Serve's own ``@serve.batch`` is not used:
the Batcher joins requests only once it has shown that joining gives each its own result, a
failing request fails alone, it serves a lone request at once, and it fills graphwrap's buckets.

Over HTTP, a request is JSON: one array ``{"inputs": [[...], ...]}`` or named inputs
``{"inputs": {"input_ids": [[...]], "attention_mask": [[...]]}}`` (``graphwrap.serve.wire`` says how
dtypes are chosen), or whatever ``preprocess`` reads; the answer is ``{"outputs": ...}``, the
module's outputs (tensors as nested lists) or what ``postprocess`` returns. A malformed request
gets status 400, one past the limits 413, one the model refuses (a wrong width, a value it
checks) 422, any other failure 500, each with ``{"error": ...}``; the replica goes on serving.
Through a deployment handle, ``handle.infer.remote(*args, **kwargs)`` takes tensors and returns
the outputs with their tensors on the CPU; ``handle.stats.remote()`` returns the replica's stats.
"""

import dataclasses
import inspect
import time
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

from ..core.tree import map_tensors
from ..errors import GraphwrapError
from ..loops.batcher import Batcher
from ..module import GraphedModule
from ..options import Options
from .wire import DTYPES, Limits, RequestError, check_limits, parse_body, read_inputs, status_of, to_json

MAX_ONGOING_REQUESTS = 256  # requests one replica holds at a time (Ray Serve's default is 5)


class Server:
    """What runs in each Ray Serve replica (also usable without Ray, e.g. to try it out).

    Args:
        factory: builds the model (no arguments); it is moved to this replica's device.
        sample: an input, a tuple of inputs or a dict of keyword inputs to capture every bucket
            with when the replica starts.
        graphed, batcher: keyword arguments of the :class:`GraphedModule` and the :class:`Batcher`.
        preprocess: ``preprocess(body) -> inputs``, run in the replica on each HTTP body (a JSON
            object): a tensor, a tuple of positional inputs or a dict of keyword inputs (a
            tokenizer's output, for instance). Its failure is the client's (400).
        postprocess: ``postprocess(outputs, inputs) -> answer``, run in the replica on each
            request's outputs (HTTP and handles), e.g. masked mean pooling; ``inputs`` is what
            the module was given, as a dict of keyword inputs or a tuple of positional ones.
        limits: :class:`graphwrap.serve.wire.Limits` (body bytes, rows, length, id bounds), or a dict of
            them; they apply to handle calls too.
        dtypes: input name (None for one array) -> torch dtype, fixed by the server.
    """

    def __init__(self, factory: Callable[[], nn.Module], sample=None, graphed: Optional[dict] = None,
                 batcher: Optional[dict] = None, preprocess: Optional[Callable] = None,
                 postprocess: Optional[Callable] = None, limits=None, dtypes: Optional[Dict] = None):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.limits, self.dtypes = check_args(factory, graphed, batcher, limits, dtypes)
        self.preprocess, self.postprocess = preprocess, postprocess
        model = factory()
        if not isinstance(model, nn.Module):
            raise GraphwrapError(f"the factory returned {type(model).__name__}, not an nn.Module")
        self.limits = with_config_bounds(self.limits, model)
        self.gm = GraphedModule(model.to(self.device).eval(), **(graphed or {}))
        if sample is not None and self.device.type == "cuda":
            # on the host, as requests arrive (over HTTP and through handles): inputs on the host
            # and on the GPU are different signatures, each with graphs of its own
            args, kwargs = _as_call(sample)
            host = lambda t: t.cpu()  # noqa: E731
            self.gm.capture(*map_tensors(host, args), **map_tensors(host, kwargs))
        self.batcher = Batcher(self.gm, **(batcher or {}))
        self.metrics = _Metrics.make()
        self.answered: Dict[int, int] = {}

    async def __call__(self, request):
        t0 = time.perf_counter()
        try:
            method = getattr(request, "method", "POST")
            if method != "POST":
                raise RequestError(405, f"{method} is not served: send a POST with a JSON body")
            answer, status = {"outputs": to_json(await self._http(request))}, 200
        except RequestError as e:
            answer, status = {"error": e.message}, e.status
        except Exception as e:  # noqa: BLE001 - answered, and the replica goes on
            answer, status = {"error": f"{type(e).__name__}: {e}"}, status_of(e)
        self.answered[status] = self.answered.get(status, 0) + 1
        if self.metrics is not None:
            self.metrics.observe(status, time.perf_counter() - t0, self.stats)
        if status == 200:
            return answer
        from starlette.responses import JSONResponse  # Ray Serve's own dependency

        return JSONResponse(answer, status_code=status)

    async def _http(self, request):
        body = parse_body(await _body(request), self.limits)
        if self.preprocess is not None:
            try:
                args, kwargs = _as_call(self.preprocess(body))
            except RequestError:
                raise
            except Exception as e:  # noqa: BLE001 - what preprocess cannot read is the client's error
                raise RequestError(400, f"preprocess: {type(e).__name__}: {e}") from None
        else:
            args, kwargs = read_inputs(body, self.dtypes, self.limits.non_finite)
        return await self.infer(*args, **kwargs)

    async def infer(self, *args, **kwargs) -> Any:
        check_limits(args, kwargs, self.limits, self.gm.engine.opts.seq_dim)
        out = await self.batcher.acall(*args, **kwargs)  # host tensors are copied in by graphwrap
        if self.postprocess is not None:
            inputs = map_tensors(lambda t: t.to(self.device), kwargs if kwargs else args)
            out = self.postprocess(out, inputs)
        return map_tensors(lambda t: t.cpu(), out)

    def stats(self) -> dict:
        return {"device": str(self.device), "batcher": self.batcher.stats(), "graphs": self.gm.stats(),
                "http_status": dict(self.answered),
                "metrics": self.metrics.names() if self.metrics is not None else []}


def check_args(factory, graphed, batcher, limits, dtypes):
    """``(limits, dtypes)`` as a :class:`Server` keeps them; GraphwrapError, naming the argument
    and the fix, for one that could not work (checked before any replica starts)."""
    if isinstance(factory, nn.Module) or not callable(factory):
        raise GraphwrapError(f"factory must be a function that builds the model, got {type(factory).__name__}: pass "
                             "e.g. lambda: MyModel(), so that each replica builds its own")
    for name, given, fields in (("graphed", graphed, _fields(GraphedModule.__init__)),
                                ("batcher", batcher, _fields(Batcher.__init__))):
        if given is not None and not isinstance(given, dict):
            raise GraphwrapError(f"{name} must be a dict of keyword arguments, got {given!r}")
        unknown = sorted(set(given or {}) - fields)
        if unknown:
            raise GraphwrapError(f"{name} takes {sorted(fields)}, got {unknown}")
    if graphed:
        Options(**{k: v for k, v in graphed.items() if k != "module"}).check()
    if limits is not None and not isinstance(limits, (Limits, dict)):
        raise GraphwrapError(f"limits must be a graphwrap.serve.wire.Limits or a dict of its fields, got {limits!r}")
    if isinstance(limits, dict):
        unknown = sorted(set(limits) - {f.name for f in dataclasses.fields(Limits)})
        if unknown:
            raise GraphwrapError(f"limits takes {[f.name for f in dataclasses.fields(Limits)]}, got {unknown}")
        limits = Limits(**limits)
    if dtypes is not None and not isinstance(dtypes, dict):
        raise GraphwrapError(f"dtypes must be a dict of input name (None for one array) to dtype, got {dtypes!r}")
    chosen = {}
    for name, dtype in (dtypes or {}).items():
        if name is not None and not isinstance(name, str):
            raise GraphwrapError(f"dtypes keys are input names, or None for one array, got {name!r}")
        if isinstance(dtype, str) and dtype in DTYPES:
            dtype = DTYPES[dtype]
        if not isinstance(dtype, torch.dtype):
            raise GraphwrapError(f"dtypes[{name!r}] must be a torch dtype or one of {sorted(DTYPES)}, got {dtype!r}")
        chosen[name] = dtype
    return limits or Limits(), chosen


def _fields(init) -> set:
    return {p for p in inspect.signature(init).parameters if p not in ("self", "gm", "module")}


def with_config_bounds(limits: Limits, model: nn.Module) -> Limits:
    """``limits`` with the id bounds of a Hugging Face model's config (``vocab_size`` for
    ``input_ids``, ``type_vocab_size`` for ``token_type_ids``) where ``id_bounds`` names none."""
    if limits.id_bounds is not None:
        return limits
    cfg = getattr(model, "config", None)
    bounds = {name: getattr(cfg, attr) for name, attr in (("input_ids", "vocab_size"),
                                                          ("token_type_ids", "type_vocab_size"))
              if isinstance(getattr(cfg, attr, None), int) and getattr(cfg, attr) > 0}
    return dataclasses.replace(limits, id_bounds=bounds) if bounds else limits


def _as_call(inputs):
    """``(args, kwargs)`` from a tensor, a tuple or list of positional inputs, or a mapping of
    keyword inputs (a tokenizer's ``BatchEncoding`` among them)."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if hasattr(inputs, "keys") and hasattr(inputs, "__getitem__"):
        return (), {str(k): inputs[k] for k in inputs.keys()}
    raise GraphwrapError(f"inputs must be a tensor, a tuple of inputs or a mapping of named inputs, "
                         f"not {type(inputs).__name__}")


async def _body(request) -> bytes:
    if callable(getattr(request, "body", None)):
        return await request.body()
    import json  # a stand-in request that only has json()

    return json.dumps(await request.json()).encode()


class _Metrics:
    """The replica's figures through ``ray.util.metrics`` (shown by Ray's Prometheus endpoint and
    its Grafana dashboards): requests by status and their latency on every request, and the
    Batcher's and graphs' stats at most every ``EVERY_S`` seconds."""

    EVERY_S = 5.0
    GAUGES = {
        "graphwrap_module_calls": "module calls (joined calls count one)",
        "graphwrap_requests_per_call": "requests per module call",
        "graphwrap_queue_wait_ms_p50": "median wait of a request in the queue, ms",
        "graphwrap_queue_wait_ms_p99": "99th percentile wait of a request in the queue, ms",
        "graphwrap_service_ms_p50": "median time of a module call, ms",
        "graphwrap_padded_share": "share of the rows computed that were padding",
        "graphwrap_padded_token_share": "share of the tokens computed that were padding",
        "graphwrap_graph_pool_bytes": "bytes held by the graph pool",
        "graphwrap_eager_calls": "calls run eagerly, by reason",
    }

    def __init__(self, metrics):
        self.requests = metrics.Counter("graphwrap_requests", description="HTTP requests answered, by status",
                                        tag_keys=("status",))
        self.latency = metrics.Histogram("graphwrap_request_seconds", description="time to answer a request, s",
                                         boundaries=[0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5])
        self.gauges = {name: metrics.Gauge(name, description=d, tag_keys=("reason",) if "eager" in name else ())
                       for name, d in self.GAUGES.items()}
        self.last = 0.0

    @classmethod
    def make(cls) -> Optional["_Metrics"]:
        try:
            from ray.util import metrics
        except ImportError:
            return None
        try:
            return cls(metrics)
        except Exception:  # noqa: BLE001 - outside a Ray worker: no metrics, the server still serves
            return None

    def names(self):
        return ["graphwrap_requests", "graphwrap_request_seconds", *self.gauges]

    def observe(self, status: int, seconds: float, stats: Callable[[], dict]):
        self.requests.inc(1, tags={"status": str(status)})
        self.latency.observe(seconds)
        now = time.monotonic()
        if now - self.last < self.EVERY_S:
            return
        self.last = now
        s = stats()
        b, g = s["batcher"], s["graphs"]
        values = {
            "graphwrap_module_calls": b["module_calls"], "graphwrap_requests_per_call": b["requests_per_call"],
            "graphwrap_queue_wait_ms_p50": b["queue_wait_ms"]["p50"], "graphwrap_queue_wait_ms_p99":
            b["queue_wait_ms"]["p99"], "graphwrap_service_ms_p50": b["service_ms"]["p50"],
            "graphwrap_padded_share": g["padded_share"], "graphwrap_padded_token_share": g["padded_token_share"],
            "graphwrap_graph_pool_bytes": g["graph_pool_bytes"],
        }
        for name, v in values.items():
            if v is not None:
                self.gauges[name].set(float(v))
        for reason, n in g["eager_calls"].items():
            self.gauges["graphwrap_eager_calls"].set(float(n), tags={"reason": reason[:100]})


def deployment(factory: Callable[[], nn.Module], *, sample=None, name: str = "graphwrap", num_replicas: int = 1,
               num_gpus: Optional[float] = None, graphed: Optional[dict] = None, batcher: Optional[dict] = None,
               preprocess: Optional[Callable] = None, postprocess: Optional[Callable] = None, limits=None,
               dtypes: Optional[Dict] = None, **deployment_options):
    """A Ray Serve application serving ``factory()``'s model through graphwrap; run it with
    ``ray.serve.run(...)``.

    Args:
        factory: builds the model (no arguments), in each replica; it is moved to the replica's GPU.
        sample: an input (or a tuple of inputs) to capture every bucket with when a replica starts.
        name: the deployment's name.
        num_replicas: replicas (each a process with a GPU of its own when ``num_gpus`` is 1).
        num_gpus: GPUs per replica (default: 1 if this machine has CUDA, else 0).
        graphed: keyword arguments of each replica's :class:`GraphedModule`.
        batcher: keyword arguments of each replica's :class:`Batcher`.
        preprocess, postprocess, limits, dtypes: as :class:`Server` takes them.
        **deployment_options: further options of ``ray.serve.deployment``; ``max_ongoing_requests``
            defaults to :data:`MAX_ONGOING_REQUESTS` (256) rather than Ray's 5, so that the
            replica's Batcher sees enough requests to join.
    """
    check_args(factory, graphed, batcher, limits, dtypes)  # here, not in each replica as it starts
    try:
        from ray import serve
    except ImportError as e:
        raise GraphwrapError('graphwrap.serve needs Ray Serve: pip install "graphwrap[serve]" (or "ray[serve]")') from e
    if num_gpus is None:
        num_gpus = 1 if torch.cuda.is_available() else 0
    actor = dict(deployment_options.pop("ray_actor_options", None) or {})
    actor.setdefault("num_gpus", num_gpus)
    # Ray Serve sends a replica at most 5 requests at a time by default; the Batcher can only join
    # what it is sent, so let it have many (its own queue holds them).
    deployment_options.setdefault("max_ongoing_requests", MAX_ONGOING_REQUESTS)
    cls = serve.deployment(name=name, num_replicas=num_replicas, ray_actor_options=actor,
                           **deployment_options)(Server)
    return cls.bind(factory, sample, graphed, batcher, preprocess, postprocess, limits, dtypes)
