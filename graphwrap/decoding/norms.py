"""A Llama-form RMSNorm in one kernel inside the shared batch's forwards.

transformers' RMSNorm of Llama and the families copied from it (Mistral, Qwen2, ...) is eight
kernels: the input to fp32, its square, the mean, ``+ eps``, ``rsqrt``, the product, back to the
input's dtype, the weight's product. Two norms a layer make 16 of the some 40 small kernels a
layer of the 1.1B Llama shape's decode step, which a graph replays one after another
(``benchmarks/diagnostics/step_profile.py``). PyTorch's ``rms_norm`` is one kernel on a GPU
(``aten::_fused_rms_norm``, from torch 2.8): it reads the input once, sums its squares in fp32 and
writes ``x * rsqrt(mean + eps)`` in the input's dtype, which is what transformers computes, to the
order of the sum; the weight's product stays a kernel of its own, as there.

:func:`prepare` replaces the ``forward`` of each such norm class in a model with one that takes
the fused kernel only on a thread between :func:`enter` and :func:`leave` (the batch's captures
and eager forwards, inside its :class:`~.attention.folding` block)
and on a GPU, and is the class's own ``forward`` everywhere else: another thread running the model
meanwhile, any CPU, and any tracing by ``torch.compile`` (which fuses the norm itself). A class is
taken only where its ``forward`` is, instruction for instruction, Llama's (Gemma's norm, which
scales by ``1 + weight``, is not).
"""

import threading
from typing import Callable, Dict

import torch
from torch.nn import functional as F

_LOCAL = threading.local()
_LOCK = threading.Lock()
_ORIGINAL: Dict[type, Callable] = {}  # a class whose forward was replaced -> its own
DEVICES = ("cuda",)  # where the fused kernel is one kernel


def available() -> bool:
    """Whether this torch has the fused kernel (``aten::_fused_rms_norm``)."""
    return hasattr(torch.ops.aten, "_fused_rms_norm")


def enter():
    """From here until :func:`leave`, on this thread, the norms :func:`prepare` took run fused
    (nested pairs count)."""
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1


def leave():
    _LOCAL.depth -= 1


def fuses(x: torch.Tensor) -> bool:
    """Whether a norm of ``x`` runs fused here and now."""
    # (is_compiling first: while torch.compile traces, the thread-local is not read at all)
    return not torch.compiler.is_compiling() and getattr(_LOCAL, "depth", 0) > 0 and x.device.type in DEVICES


def llama_form(cls: type) -> bool:
    """Whether ``cls.forward`` is Llama's RMSNorm forward, instruction for instruction."""
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError:
        return False
    forward = _ORIGINAL.get(cls, getattr(cls, "forward", None))
    code, want = getattr(forward, "__code__", None), _ORIGINAL.get(LlamaRMSNorm, LlamaRMSNorm.forward).__code__
    return code is not None and (code.co_code, code.co_names, code.co_consts) == (want.co_code, want.co_names,
                                                                                   want.co_consts)


def prepare(model) -> int:
    """Replace the ``forward`` of each Llama-form norm class in ``model`` (once per class; where
    the fused kernel exists): how many of its modules are such norms."""
    if not available():
        return 0
    n = 0
    for m in model.modules():
        cls = type(m)
        if cls in _ORIGINAL or llama_form(cls):
            n += 1
            with _LOCK:
                if cls not in _ORIGINAL:
                    _ORIGINAL[cls] = cls.forward
                    cls.forward = _fused_or_own(cls.forward)
    return n


def _fused_or_own(own: Callable) -> Callable:
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if fuses(hidden_states):
            return self.weight * F.rms_norm(hidden_states, (hidden_states.shape[-1],), None, self.variance_epsilon)
        return own(self, hidden_states)

    forward.__wrapped__ = own  # type: ignore[attr-defined]
    forward.__doc__ = own.__doc__
    return forward
