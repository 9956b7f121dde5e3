"""graphwrap: bucketed CUDA-graph capture and replay for any PyTorch module.

``gm = graphwrap.GraphedModule(model)``, then ``gm(x)`` exactly as ``model(x)``, any batch size.
Imports on machines without CUDA; there every call runs the module eagerly.
"""

__version__ = "0.2.0"

from . import log as _log

_log.install()

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
from .decoding.engine.grammar import Grammar, GrammarError
from .errors import GraphwrapError
from .loops.batcher import Batcher
from .loops.pipeline import Inputs
from .module import GraphedModule
from .quantized import quantize
from .serve.replicas import Replicas

__all__ = [
    "GraphedModule", "Batcher", "Replicas", "GraphwrapError", "Grammar", "GrammarError", "Inputs", "save_compile_cache", "load_compile_cache",
    "quantize",
    "Adaptive", "BucketTable", "default_buckets", "exact_buckets", "fit_buckets", "padded_rows", "__version__",
]
