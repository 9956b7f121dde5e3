"""An OpenAI-compatible HTTP server over the shared decode batch: ``python -m graphwrap serve
MODEL`` on one machine (:mod:`.cli`), the same app in each replica of a Ray Serve deployment
(:func:`~.ray.generation_deployment`). FastAPI and uvicorn come with the ``serve``
extra and are imported here only, on first use of these names (:mod:`graphwrap._lazy`): the
server's process starts its engine process before it imports them."""

from typing import TYPE_CHECKING

from ..._lazy import exports

__getattr__, __dir__ = exports(__name__, {name: (".app", name) for name in ("Served", "make_app")})

if TYPE_CHECKING:
    from .app import Served, make_app

__all__ = ["Served", "make_app"]
