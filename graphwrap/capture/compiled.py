"""The module's forward compiled by Inductor without Inductor's own CUDA graphs.

graphwrap warms up and captures this compiled forward into its bucket graphs, so each
replay runs fused kernels with no launch gaps. By default (``dynamic="batch"``) the batch
dimension of every input is marked dynamic, so one compile serves every bucket of two rows or
more. Every compilation passes through :class:`CompiledForward`'s backend, which counts it: a
bucket whose warm-up compiled nothing for a new shape did not run compiled code, and is
reported so.

Per-size kernels: shape-generic kernels can be slower than kernels compiled for one shape
(Inductor turns off, for instance, its channels-last layout for convolutions whose batch is
dynamic: 1.5x slower on resnet50). With ``static="auto"`` (default, with ``dynamic="batch"``)
a thread of the engine compiles kernels for the shape of each bucket that serves calls, hot
buckets first, captures them, times both graphs and keeps the faster (see ``tuning``).

The compile cache: ``compile={"cache": path}`` loads the artifacts saved there (Inductor's and
AOTAutograd's caches, through ``torch.compiler.load_cache_artifacts``) before the first
compile and saves them again after :meth:`GraphedModule.capture`; :func:`save_cache` and
:func:`load_cache` do the same by hand. A new process on another machine with the same model,
torch and GPU then skips Inductor's code generation and Triton's compilation.
"""

import logging
import os
import types
from typing import Optional, Set

import torch

from ..errors import GraphwrapError
from ..process import COMPILE_IDS, COMPILE_LOCK

OPTIONS = ("mode", "options", "dynamic", "fullgraph", "cache", "static")
logger = logging.getLogger("graphwrap")
_GRAPH_MODES = ("reduce-overhead", "max-autotune")
_LIMIT = 1 << 16
# Dynamo's config patch (_limits) is process-wide: two threads inside compiled forwards at once
# (a capture and the tuner's compile) would restore each other's limits. One at a time.


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
    if mode not in (None, "default", "max-autotune-no-cudagraphs") and mode not in _GRAPH_MODES:
        raise GraphwrapError(f'compile mode {mode!r} is not a torch.compile mode graphwrap can capture: use "default" '
                             'or "max-autotune-no-cudagraphs"')
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
    dynamic = opts.setdefault("dynamic", "batch")
    if dynamic not in (True, False, "batch"):
        raise GraphwrapError(
            f'compile dynamic= must be "batch" (one compile for every bucket), False (kernels for each bucket\'s '
            f"shape) or True (every dimension dynamic), got {dynamic!r}"
        )
    static = opts.setdefault("static", "auto" if dynamic == "batch" else False)
    if static not in ("auto", False):
        raise GraphwrapError(
            f'compile static= must be "auto" (kernels compiled for a hot bucket\'s own shape in the background, '
            f"kept where faster) or False (the shared kernels only), got {static!r}"
        )
    if static and dynamic != "batch":
        raise GraphwrapError(f'compile static="auto" tunes the shared kernels of dynamic="batch"; with dynamic={dynamic!r} '
                             "leave it out")
    opts.setdefault("fullgraph", False)
    cache = opts.setdefault("cache", None)
    if cache is not None and not isinstance(cache, (str, os.PathLike)):
        raise GraphwrapError(f"compile cache= is a file path, got {cache!r}")
    if cache is not None:
        reason = cache_unavailable_reason()
        if reason is not None:
            raise GraphwrapError(f"compile cache= needs {reason}; leave it out to compile afresh")
    return opts


def cache_unavailable_reason() -> Optional[str]:
    """Why this torch cannot save and load compile artifacts, or None."""
    compiler = getattr(torch, "compiler", None)
    if compiler is None or not hasattr(compiler, "save_cache_artifacts") or not hasattr(compiler, "load_cache_artifacts"):
        return (f"torch.compiler.save_cache_artifacts and load_cache_artifacts, which torch {torch.__version__} "
                "does not have (they came with torch 2.7)")
    return None


def save_cache(path) -> int:
    """Write what compiling produced in this process (Inductor's and AOTAutograd's cache
    artifacts) to ``path``; the bytes written (0 if nothing was compiled)."""
    reason = cache_unavailable_reason()
    if reason is not None:
        raise GraphwrapError(f"saving the compile cache needs {reason}")
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    data = saved[0]
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    logger.info("saved %d bytes of compile artifacts to %s", len(data), path)
    return len(data)


def load_cache(path) -> bool:
    """Load compile artifacts saved by :func:`save_cache`; False if ``path`` does not exist."""
    reason = cache_unavailable_reason()
    if reason is not None:
        raise GraphwrapError(f"loading the compile cache needs {reason}")
    if not os.path.exists(path):
        return False
    with open(path, "rb") as f:
        data = f.read()
    torch.compiler.load_cache_artifacts(data)
    logger.info("loaded %d bytes of compile artifacts from %s", len(data), path)
    return True


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

    code = forward.__code__.replace(co_name=f"graphwrap_forward_{next(COMPILE_IDS)}")
    return types.FunctionType(code, forward.__globals__, code.co_name, forward.__defaults__, forward.__closure__)


class CompiledForward:
    """``module`` compiled with Inductor (no CUDA graphs), counting the graphs it compiles."""

    def __init__(self, module: torch.nn.Module, opts: dict):
        self.opts = opts
        self.graphs = 0  # FX graphs compiled so far
        self.shapes: Set[tuple] = set()  # (key, bucket) that ran compiled code, kept by GraphedModule
        # A run ahead of the next capture (the shared batch compiles before it captures): the graphs
        # it compiled, counted as that capture's warm-up's; None where none ran since the last one.
        self.ahead: Optional[int] = None
        self.batch = opts["dynamic"] == "batch"
        self.dynamic = opts["dynamic"] is not False  # one compile may serve several shapes
        dynamic = None if self.batch else opts["dynamic"]  # "batch": dims marked dynamic, the rest static
        inductor = torch._TorchCompileInductorWrapper(opts["mode"], opts["options"], dynamic)

        def backend(gm, example_inputs):
            self.graphs += 1
            return inductor(gm, example_inputs)

        self.fn = torch.compile(_own_entry(module), backend=backend, dynamic=dynamic, fullgraph=opts["fullgraph"])

    def mark(self, leaves, roles):
        """With ``dynamic="batch"``: mark the batch dimension (and the sequence dimension) of each
        input dynamic, so this compile serves every bucket of two rows (and positions) or more.
        A dimension of size 1 is left alone: dynamo specializes sizes 0 and 1, and would raise
        for a dimension marked dynamic."""
        if not self.batch:
            return
        for t, (bd, sd, _) in zip(leaves, roles):
            for d in (bd, sd):
                if d is not None and t.dim() > d and t.shape[d] >= 2:
                    torch._dynamo.mark_dynamic(t, d)

    def __call__(self, *args, **kwargs):
        with COMPILE_LOCK, _limits():
            return self.fn(*args, **kwargs)


def static_options(opts: dict) -> dict:
    """The options of the per-size compile that tunes a ``dynamic="batch"`` one."""
    return dict(opts, dynamic=False, static=False)
