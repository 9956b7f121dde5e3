"""Serving: every GPU of a host (:class:`~graphwrap.serve.replicas.Replicas`), requests over
HTTP read into a module's inputs (:mod:`~graphwrap.serve.wire`), and a Ray Serve deployment
(:func:`deployment`; Ray is imported only when it is called), and generation served with the
OpenAI API (:mod:`~graphwrap.serve.api`: ``python -m graphwrap serve``, :func:`generation_deployment`).
The names of :mod:`.ray_serve` are imported on first use (:mod:`graphwrap._lazy`).
"""

from typing import TYPE_CHECKING

from .._lazy import exports

__getattr__, __dir__ = exports(__name__, {name: (".ray_serve", name)
                                          for name in ("Server", "deployment", "with_config_bounds")})

if TYPE_CHECKING:
    from .ray_serve import Server, deployment, with_config_bounds


def generation_deployment(model: str, **options):
    """The OpenAI-compatible server as a Ray Serve application, a shared decode batch per replica
    (:func:`graphwrap.serve.api.ray.generation_deployment`; needs ``graphwrap[serve]``)."""
    from .api.ray import generation_deployment as make

    return make(model, **options)


__all__ = ["Server", "deployment", "generation_deployment", "with_config_bounds"]
