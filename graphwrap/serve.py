"""Ray Serve: a deployment that serves a model through graphwrap on each replica's GPU.

``pip install "graphwrap[serve]"``; Ray is imported here only, when :func:`deployment` is called.

Ray Serve routes requests to replicas, scales them and restarts them; each replica builds the
model on its GPU, wraps it in a :class:`graphwrap.GraphedModule`, captures every bucket when it
starts (with ``sample``), so the first request is fast, and joins the requests it receives in
a :class:`graphwrap.Batcher` on its event loop. Ray Serve's own ``@serve.batch`` is not used:
the Batcher joins requests only once it has shown that joining gives each its own result, it
serves a lone request at once, and it fills graphwrap's buckets.

Over HTTP, a request is JSON ``{"inputs": [[...], ...], "dtype": "float32"}`` (one tensor,
batch first) and the answer ``{"outputs": ...}`` (tensors as nested lists); an input the model
rejects gets status 400 with ``{"error": ...}``, a failure of the model status 500, and the
replica goes on serving. Through a deployment handle, ``handle.infer.remote(*args, **kwargs)``
takes tensors and returns the outputs with their tensors on the CPU.
"""

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn

from .batcher import Batcher
from .errors import GraphwrapError
from .module import GraphedModule
from .tree import map_tensors


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().tolist()
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


class Server:
    """What runs in each Ray Serve replica (also usable without Ray, e.g. to try it out)."""

    def __init__(self, factory: Callable[[], nn.Module], sample=None, graphed: Optional[dict] = None,
                 batcher: Optional[dict] = None):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = factory()
        if not isinstance(model, nn.Module):
            raise GraphwrapError(f"the factory returned {type(model).__name__}, not an nn.Module")
        self.gm = GraphedModule(model.to(self.device).eval(), **(graphed or {}))
        if sample is not None and self.device.type == "cuda":
            args = sample if isinstance(sample, tuple) else (sample,)
            self.gm.capture(*map_tensors(lambda t: t.to(self.device), args))
        self.batcher = Batcher(self.gm, **(batcher or {}))

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        try:
            body = await request.json()
            x = torch.tensor(body["inputs"], dtype=getattr(torch, body.get("dtype", "float32")))
        except Exception as e:  # noqa: BLE001 - a malformed request is the client's error
            return JSONResponse({"error": f"bad request: {type(e).__name__}: {e}"}, status_code=400)
        try:
            out = await self.batcher.acall(x)
        except (GraphwrapError, ValueError, TypeError, IndexError) as e:
            return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=400)
        except Exception as e:  # noqa: BLE001 - answered, and the replica goes on
            return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=500)
        return {"outputs": _jsonable(out)}

    async def infer(self, *args, **kwargs) -> Any:
        out = await self.batcher.acall(*args, **kwargs)
        return map_tensors(lambda t: t.cpu(), out)

    def stats(self) -> dict:
        return {"device": str(self.device), "batcher": self.batcher.stats(), "graphs": self.gm.stats()}


def deployment(factory: Callable[[], nn.Module], *, sample=None, name: str = "graphwrap", num_replicas: int = 1,
               num_gpus: Optional[float] = None, graphed: Optional[dict] = None, batcher: Optional[dict] = None,
               **deployment_options):
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
        **deployment_options: further options of ``ray.serve.deployment``.
    """
    try:
        from ray import serve
    except ImportError as e:
        raise GraphwrapError('graphwrap.serve needs Ray Serve: pip install "graphwrap[serve]"') from e
    if num_gpus is None:
        num_gpus = 1 if torch.cuda.is_available() else 0
    actor = dict(deployment_options.pop("ray_actor_options", None) or {})
    actor.setdefault("num_gpus", num_gpus)
    cls = serve.deployment(name=name, num_replicas=num_replicas, ray_actor_options=actor,
                           **deployment_options)(Server)
    return cls.bind(factory, sample, graphed, batcher)
