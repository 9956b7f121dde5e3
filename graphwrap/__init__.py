"""graphwrap: bucketed CUDA-graph capture and replay for any PyTorch module.

``gm = graphwrap.GraphedModule(model)``, then ``gm(x)`` exactly as ``model(x)``, any batch size.
Imports on machines without CUDA; there every call runs the module eagerly.
"""

__version__ = "0.1.0"

from .batcher import Batcher
from .buckets import Adaptive, BucketTable, default_buckets, exact_buckets, fit_buckets, padded_rows
from .errors import GraphwrapError
from .module import GraphedModule
from .pipeline import Inputs

__all__ = [
    "GraphedModule", "Batcher", "GraphwrapError", "Inputs", "Adaptive", "BucketTable",
    "default_buckets", "exact_buckets", "fit_buckets", "padded_rows", "__version__",
]
