"""graphwrap: bucketed CUDA-graph capture and replay for any PyTorch module.

``gm = graphwrap.GraphedModule(model)``, then ``gm(x)`` exactly as ``model(x)``, any batch size.
Imports on machines without CUDA; there every call runs the module eagerly. The names below
are imported on first use (:mod:`graphwrap._lazy`).
"""

from typing import TYPE_CHECKING

__version__ = "0.2.0"

from . import log as _log
from ._lazy import exports

_log.install()

__all__ = [
    "GraphedModule", "Batcher", "Replicas", "GraphwrapError", "Grammar", "GrammarError", "Inputs", "save_compile_cache", "load_compile_cache",
    "quantize",
    "Adaptive", "BucketTable", "default_buckets", "exact_buckets", "fit_buckets", "padded_rows", "__version__",
]

__getattr__, __dir__ = exports(__name__, {
    "load_compile_cache": (".capture.compiled", "load_cache"),
    "save_compile_cache": (".capture.compiled", "save_cache"),
    **{name: (".core.buckets", name) for name in ("Adaptive", "BucketTable", "default_buckets", "exact_buckets",
                                                   "fit_buckets", "padded_rows")},
    "Grammar": (".decoding.callers.grammar", "Grammar"),
    "GrammarError": (".decoding.callers.grammar", "GrammarError"),
    "GraphwrapError": (".errors", "GraphwrapError"),
    "Batcher": (".loops.batcher", "Batcher"),
    "Inputs": (".loops.pipeline", "Inputs"),
    "GraphedModule": (".module", "GraphedModule"),
    "quantize": (".quantized", "quantize"),
    "Replicas": (".serve.replicas", "Replicas"),
})

if TYPE_CHECKING:
    from .capture.compiled import load_cache as load_compile_cache
    from .capture.compiled import save_cache as save_compile_cache
    from .core.buckets import (
        Adaptive,
        BucketTable,
        default_buckets,
        exact_buckets,
        fit_buckets,
        padded_rows,
    )
    from .decoding.callers.grammar import Grammar, GrammarError
    from .errors import GraphwrapError
    from .loops.batcher import Batcher
    from .loops.pipeline import Inputs
    from .module import GraphedModule
    from .quantized import quantize
    from .serve.replicas import Replicas
