"""The OpenAI-compatible app past one machine: a Ray Serve deployment whose every replica loads
the model on a GPU of its own and serves the same app (:mod:`.app`) over its own shared decode
batch, behind Ray's HTTP proxy. Ray is imported here only."""

from typing import List, Optional

import torch

from ...errors import GraphwrapError

MAX_ONGOING_REQUESTS = 1024  # requests one replica holds at a time: its batch and queue decide, not Ray's 5


def generation_deployment(model: str, *, args: Optional[List[str]] = None, name: str = "graphwrap-generate",
                          num_replicas: int = 1, num_gpus: Optional[float] = None, routing: str = "prefix",
                          **deployment_options):
    """A Ray Serve application serving ``model`` (a Hugging Face model directory or a hub id in
    the local cache, reachable from every node) with the OpenAI API; run it with
    ``ray.serve.run(app, route_prefix="/")``.

    Args:
        model: what ``python -m graphwrap serve MODEL`` takes.
        args: further options of ``python -m graphwrap serve`` (``["--dtype", "bfloat16",
            "--rows", "32"]``); those of uvicorn (host, port, drain) are Ray's to set.
        num_replicas: replicas, each one process with one GPU (``num_gpus=1``) and one batch.
        num_gpus: GPUs per replica (default: 1 where this machine has CUDA, else 0).
        routing: with more than one replica, ``"prefix"``: an ingress that tokenizes each request
            and sends it to the engine replica given a prompt starting alike
            (:mod:`.ray_routed`); ``"proxy"``: every replica the whole app, chosen by Ray's proxy.
        **deployment_options: further options of ``ray.serve.deployment``.
    """
    try:
        from ray import serve
    except ImportError as e:
        raise GraphwrapError('the Ray Serve deployment needs Ray Serve: pip install "graphwrap[serve]"') from e
    from .cli import parser

    argv = [model, *(args or [])]
    try:
        parser().parse_args(argv)  # a bad option fails here, not in each replica as it starts
    except SystemExit:
        raise GraphwrapError(f"the options {argv[1:]} are not those of python -m graphwrap serve "
                             "(python -m graphwrap serve --help lists them)") from None
    if num_gpus is None:
        num_gpus = 1 if torch.cuda.is_available() else 0
    actor = dict(deployment_options.pop("ray_actor_options", None) or {})
    actor.setdefault("num_gpus", num_gpus)
    deployment_options.setdefault("max_ongoing_requests", MAX_ONGOING_REQUESTS)
    if routing not in ("prefix", "proxy"):
        raise GraphwrapError(f"routing must be 'prefix' or 'proxy', got {routing!r}")
    if routing == "prefix" and num_replicas > 1:
        from .ray_routed import deployments

        return deployments(model, argv, num_replicas, actor, name, **deployment_options)

    def build():  # in each replica, as it starts
        from .app import make_app
        from .cli import load

        return make_app(load(parser().parse_args(argv), engine="thread"))  # (a replica is a process of its own)

    ingress = serve.ingress(build)()
    return serve.deployment(ingress, name=name, num_replicas=num_replicas, ray_actor_options=actor,
                            **deployment_options).bind()
