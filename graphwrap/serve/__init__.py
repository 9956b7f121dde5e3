"""Serving: every GPU of a host (:class:`~graphwrap.serve.replicas.Replicas`), requests over
HTTP read into a module's inputs (:mod:`~graphwrap.serve.wire`), and a Ray Serve deployment
(:func:`deployment`; Ray is imported only when it is called).
"""

from .ray_serve import Server, deployment, with_config_bounds

__all__ = ["Server", "deployment", "with_config_bounds"]
