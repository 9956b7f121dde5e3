"""The module's forward compiled by Inductor without Inductor's own CUDA graphs.

graphwrap warms up and captures this compiled forward into its bucket graphs, so each
replay runs fused kernels with no launch gaps. Every compilation passes through
:class:`CompiledForward`'s backend, which counts it: a bucket whose warm-up compiled
nothing for a new shape did not run compiled code, and is reported so.
"""

import itertools
import types
from typing import Optional

import torch

from .errors import GraphwrapError

OPTIONS = ("mode", "options", "dynamic", "fullgraph")
_GRAPH_MODES = ("reduce-overhead", "max-autotune")
_LIMIT = 1 << 16
_IDS = itertools.count()


def compile_options(compile) -> Optional[dict]:
    """``compile=`` of GraphedModule checked and completed; None when off."""
    if compile is None or compile is False:
        return None
    if compile is True:
        opts = {}
    elif isinstance(compile, dict):
        opts = dict(compile)
    else:
        raise GraphwrapError(f"compile must be True, False or a dict of torch.compile options, got {compile!r}")
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise GraphwrapError(f"compile= takes the torch.compile options {list(OPTIONS)}, got {unknown}")
    mode = opts.get("mode")
    if mode in _GRAPH_MODES:
        raise GraphwrapError(
            f"compile mode {mode!r} records CUDA graphs of its own; graphwrap captures the compiled "
            'kernels itself: use mode "default" or "max-autotune-no-cudagraphs"'
        )
    options = dict(opts.get("options") or {})
    if options.get("triton.cudagraphs"):
        raise GraphwrapError('compile options "triton.cudagraphs": True conflicts with graphwrap\'s own graphs')
    if mode is not None and options:
        raise GraphwrapError("torch.compile takes mode= or options=, not both")
    if mode is None:
        options["triton.cudagraphs"] = False
    opts["options"] = options or None
    opts["mode"] = mode
    opts.setdefault("dynamic", False)  # kernels specialised to each bucket's shape
    opts.setdefault("fullgraph", False)
    return opts


def unavailable_reason() -> Optional[str]:
    """Why Inductor cannot compile for CUDA in this process, or None."""
    if not hasattr(torch, "compile") or not hasattr(torch, "_TorchCompileInductorWrapper"):
        return f"torch {torch.__version__} has no torch.compile with Inductor"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed, so Inductor cannot compile CUDA kernels"
    return None


def _limits():
    """Dynamo's recompile limits raised, and failure instead of eager when one is hit anyway.

    Each bucket is a shape of its own: with the default limit (8) the ninth bucket would run
    the forward uncompiled. The patch holds only while graphwrap warms up and captures.
    """
    import torch._dynamo.config as cfg

    patch = {}
    for names in (("recompile_limit", "cache_size_limit"),
                  ("accumulated_recompile_limit", "accumulated_cache_size_limit")):
        name = next((n for n in names if hasattr(cfg, n)), None)
        if name is not None:
            patch[name] = max(getattr(cfg, name), _LIMIT)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        patch["fail_on_recompile_limit_hit"] = True
    return cfg.patch(patch)


def _own_entry(module: torch.nn.Module):
    """A function that calls ``module``, with a code object of its own.

    Dynamo keeps compiled code, and counts recompiles, per code object. Compiling ``module``
    itself would put one entry per bucket on code that the user's own ``torch.compile`` of
    the same model shares (its ``forward``, or a decorator's wrapper): enough entries and the
    user's compile hits its recompile limit and silently runs eagerly. Through a code object
    of its own, graphwrap's entries stay apart (the forward is inlined into it).
    """

    def forward(*args, **kwargs):
        return module(*args, **kwargs)

    code = forward.__code__.replace(co_name=f"graphwrap_forward_{next(_IDS)}")
    return types.FunctionType(code, forward.__globals__, code.co_name, forward.__defaults__, forward.__closure__)


class CompiledForward:
    """``module`` compiled with Inductor (no CUDA graphs), counting the graphs it compiles."""

    def __init__(self, module: torch.nn.Module, opts: dict):
        self.opts = opts
        self.graphs = 0  # FX graphs compiled so far
        self.shapes = set()  # (key, bucket) that ran compiled code, kept by GraphedModule
        inductor = torch._TorchCompileInductorWrapper(opts["mode"], opts["options"], opts["dynamic"])

        def backend(gm, example_inputs):
            self.graphs += 1
            return inductor(gm, example_inputs)

        self.fn = torch.compile(_own_entry(module), backend=backend, dynamic=opts["dynamic"],
                                fullgraph=opts["fullgraph"])

    def __call__(self, *args, **kwargs):
        with _limits():
            return self.fn(*args, **kwargs)
