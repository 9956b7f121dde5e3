"""An OpenAI-compatible HTTP server over the shared decode batch: ``python -m graphwrap serve
MODEL`` on one machine (:mod:`.cli`), the same app in each replica of a Ray Serve deployment
(:func:`~.ray.generation_deployment`). FastAPI and uvicorn come with the ``serve``
extra and are imported here only."""

from .app import Served, make_app

__all__ = ["Served", "make_app"]
