"""Small modules of transformers' models in one kernel inside the shared batch's forwards.

A graph replays a step's kernels one after another, so a module written as many elementwise
operations costs a kernel each (2-5 us apiece on a step's small tensors;
``benchmarks/diagnostics/step_profile.py``). These have a single kernel (PyTorch's, or one of
graphwrap's in Triton) that computes the same to rounding:

- **Llama's RMSNorm** (and the families copied from it: Mistral, Qwen2, ...) is eight kernels:
  the input to fp32, its square, the mean, ``+ eps``, ``rsqrt``, the product, back to the
  input's dtype, the weight's product. PyTorch's ``rms_norm`` is one kernel on a GPU
  (``aten::_fused_rms_norm``, from torch 2.8): it reads the input once, sums its squares in fp32
  and writes ``weight * x * rsqrt(mean + eps)`` in the input's dtype, to the order of the sum
  and rounded once (transformers rounds before the weight's product too: equal to rounding).
  A weight of another dtype than the states' (fp32 over fp16) stays a product of its own, as
  there, so the result's dtype is transformers'. Gemma's norm, which scales by ``1 + weight``,
  is not this form.
- **GPT-2's GELU** (transformers' ``NewGELUActivation``, ``gelu_new``: the tanh approximation
  written out) is eight kernels: the cube, three products, two sums, ``tanh``. PyTorch's
  ``gelu(approximate="tanh")`` is the same formula in one kernel, computed in fp32 and rounded
  once (transformers' own ``gelu_pytorch_tanh``).
- **Llama's rotary embedding** (the module function ``apply_rotary_pos_emb`` with its
  ``rotate_half``, in Llama's modeling module and each family's copy of it) is ten kernels a
  layer; :mod:`.rope` is one (Triton), where the call is Llama's own (four arguments, queries
  and keys ``[b, h, s, d]``).
- **The attention's query, key and value projections** (the attention ``forward`` of Llama,
  Mistral and Qwen2, instruction for instruction) are three launches of cuBLAS; :mod:`.qkv` is
  one (Triton; and a sum of two parts where its tiles are fewer than the SMs) for a step's few
  rows, and the module's own ``forward`` runs over them. Quantized projections (FP8, int8,
  int4) whose weights share a buffer (``graphwrap.quantize``'s) make theirs as one product at any
  number of rows (:func:`graphwrap.quantized.together`).
- **Llama's gated MLP** (``LlamaMLP``'s forward, and each family's copy: Mistral, Qwen2, ...)
  runs the gate's and the up projection's products, SiLU and their product; :mod:`.mlp` is one
  kernel (Triton) for a step's few rows, where the activation is SiLU and there are no biases.
  With FP8 layers, SiLU, the product and the down projection's row scaling are one kernel at
  any number of rows; with int8 and int4 layers the gate and up projections are one product
  (:func:`graphwrap.quantized.gated`).
- **An RMSNorm whose output goes to FP8 layers** (``quantize`` marks the norms before the
  attention and the MLP) writes that output's rows in E4M3 with their scales in the same kernel
  (:func:`graphwrap.quantized.normed`), which those layers then read instead of scaling again.

:func:`prepare` replaces the ``forward`` of each class in a model whose ``forward`` is one of
these, instruction for instruction (and each such function of the modules the model's classes
come from), with one that takes the single kernel only on a thread
between :func:`enter` and :func:`leave` (the batch's captures and eager forwards, inside its
:class:`~.attention.folding` block) and on a GPU, and is the class's own ``forward`` everywhere
else: another thread running the model meanwhile, any CPU, and any tracing by ``torch.compile``
(which fuses them itself).
"""

import sys
import threading
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
from torch.nn import functional as F

from ... import quantized
from . import mlp, norm, paged_attention, qkv, rope

_LOCAL = threading.local()
_LOCK = threading.Lock()
_ORIGINAL: Dict[type, Callable] = {}  # a class whose forward was replaced -> its own
DEVICES = ("cuda",)  # where each form's kernel is one kernel


class Form(NamedTuple):
    """A module's ``forward`` with a single kernel of PyTorch's computing the same."""
    name: str
    reference: Callable[[], Optional[type]]  # transformers' class whose forward is the form (None: not here)
    fused: Callable[[Callable], Callable]  # the class's own forward -> the replacement
    available: Callable[[], bool]  # whether this torch has the kernel


def _transformers_class(module: str, name: str) -> Callable[[], Optional[type]]:
    def find() -> Optional[type]:
        try:
            return getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            return None
    return find


def _fused_norm(own: Callable) -> Callable:
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if fuses(hidden_states):
            shape, w = (hidden_states.shape[-1],), self.weight
            if w.dtype == hidden_states.dtype:  # the weight's product inside the kernel, rounded once
                if getattr(self, quantized.NORMED, False):  # (FP8 layers next: their rows scaled too)
                    out = quantized.normed(hidden_states, w, self.variance_epsilon)
                    if out is not None:
                        return out
                if norm.applies(hidden_states, w):  # (a step's few rows: graphwrap's kernel)
                    return norm.rms(hidden_states, w, self.variance_epsilon)
                return F.rms_norm(hidden_states, shape, w, self.variance_epsilon)
            return w * F.rms_norm(hidden_states, shape, None, self.variance_epsilon)  # (its own dtype's result)
        return own(self, hidden_states)
    return _wrapped(forward, own)


def _fused_gelu(own: Callable) -> Callable:
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if fuses(input):
            return F.gelu(input, approximate="tanh")
        return own(self, input)
    return _wrapped(forward, own)


def _fused_mlp(own: Callable) -> Callable:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fuses(x) and _silu(self.act_fn):
            if mlp.applies(x, self.gate_proj, self.up_proj):
                return self.down_proj(mlp.gate_up(x, self.gate_proj.weight, self.up_proj.weight))
            out = quantized.gated(x, self.gate_proj, self.up_proj, self.down_proj)  # (quantized layers)
            if out is not None:
                return out
        return own(self, x)
    return _wrapped(forward, own)


def _fused_projections(own: Callable) -> Callable:
    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if fuses(hidden_states):
            projections = [getattr(self, n, None) for n in qkv.NAMES]
            if qkv.applies(hidden_states, projections):  # (three nn.Linear)
                outs = qkv.project(hidden_states, [p.weight for p in projections],  # type: ignore[union-attr]
                                   [p.bias for p in projections])  # type: ignore[union-attr]
                return own(qkv.Given(self, hidden_states, outs), hidden_states, *args, **kwargs)
            layers = [p for p in projections if p is not None]
            made = quantized.together(hidden_states, layers) if len(layers) == 3 else None  # (FP8: one product)
            if made is not None:
                return own(qkv.Given(self, hidden_states, made), hidden_states, *args, **kwargs)
        return own(self, hidden_states, *args, **kwargs)
    return _wrapped(forward, own)


def _silu(act) -> bool:
    """Whether ``act`` is SiLU (torch's module, or transformers' whose forward is torch's silu)."""
    if isinstance(act, torch.nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:
        return False
    return type(act) is SiLUActivation


def _wrapped(forward: Callable, own: Callable) -> Callable:
    forward.__wrapped__ = own  # type: ignore[attr-defined]
    forward.__doc__ = own.__doc__
    return forward


def _fused_rope(own: Callable) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not args and not kwargs and fuses(q) and rope.applies(q, k, cos, sin):
            return rope.rotate(q, k, cos, sin)
        return own(q, k, cos, sin, *args, **kwargs)
    apply_rotary_pos_emb._gw_own = own  # type: ignore[attr-defined]
    return _wrapped(apply_rotary_pos_emb, own)


class Function(NamedTuple):
    """A module-level function of transformers' (with the helpers it calls by name) that a single
    kernel computes the same as."""
    name: str
    names: Tuple[str, ...]  # the function's name in its module, then its helpers'
    reference: str  # the module whose functions of those names are the form
    fused: Callable[[Callable], Callable]  # the module's own function -> the replacement
    available: Callable[[], bool]


FUNCTIONS = (
    Function("Llama's rotary embedding", ("apply_rotary_pos_emb", "rotate_half"),
             "transformers.models.llama.modeling_llama", _fused_rope, paged_attention.available),
)

FORMS = (
    Form("Llama's RMSNorm", _transformers_class("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
         _fused_norm, lambda: hasattr(torch.ops.aten, "_fused_rms_norm")),
    Form("GPT-2's tanh GELU", _transformers_class("transformers.activations", "NewGELUActivation"),
         _fused_gelu, lambda: True),
    Form("Llama's gated MLP", _transformers_class("transformers.models.llama.modeling_llama", "LlamaMLP"),
         _fused_mlp, paged_attention.available),
) + tuple(
    Form(f"{family}'s attention projections", _transformers_class(f"transformers.models.{module}.modeling_{module}",
                                                                  f"{family}Attention"),
         _fused_projections, paged_attention.available)
    for family, module in (("Llama", "llama"), ("Mistral", "mistral"), ("Qwen2", "qwen2")))


def enter():
    """From here until :func:`leave`, on this thread, the modules :func:`prepare` took run fused
    (nested pairs count)."""
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1


def leave():
    _LOCAL.depth -= 1
    if not _LOCAL.depth:
        quantized.forget()  # (the rows a norm scaled for FP8 layers: not kept past the forward)


def fuses(x: torch.Tensor) -> bool:
    """Whether a module taken runs its single kernel on ``x`` here and now."""
    # (is_compiling first: while torch.compile traces, the thread-local is not read at all)
    return not torch.compiler.is_compiling() and getattr(_LOCAL, "depth", 0) > 0 and x.device.type in DEVICES


def _code(forward) -> Optional[tuple]:
    """What a function does, instruction for instruction: its code, and through each decorator
    (``__wrapped__``), the decorator's code with its simple settings (a name, a version) and the
    code it wraps. (Decorated forwards share the decorator's code: transformers 5.24 wraps many
    classes' forwards in the same ``deprecate_kwarg``.)"""
    chain = []
    for _ in range(8):
        code = getattr(forward, "__code__", None)
        if code is None:
            return None
        cells = tuple(_setting(c) for c in (getattr(forward, "__closure__", None) or ()))
        chain.append((code.co_code, code.co_names, code.co_consts, cells))
        forward = getattr(forward, "__wrapped__", None)
        if forward is None:
            return tuple(chain)
    return None


def _setting(cell) -> object:
    try:
        value = cell.cell_contents
    except ValueError:  # (an empty cell)
        return None
    return value if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__


def form_of(cls: type) -> Optional[Form]:
    """The form whose reference's ``forward`` is ``cls.forward`` instruction for instruction
    (the class's own, where :func:`prepare` replaced it), or None."""
    code = _code(_ORIGINAL.get(cls, getattr(cls, "forward", None)))
    if code is None:
        return None
    for form in FORMS:
        ref = form.reference()
        if ref is not None and code == _code(_ORIGINAL.get(ref, getattr(ref, "forward", None))):
            return form
    return None


def function_form(module) -> Optional[Function]:
    """The function form whose functions ``module`` has, each instruction for instruction (its
    own, where :func:`prepare` replaced one), or None."""
    for form in FUNCTIONS:
        ref = sys.modules.get(form.reference)
        if ref is None:
            try:
                ref = __import__(form.reference, fromlist=["_"])
            except ImportError:
                continue
        ours = [getattr(module, n, None) for n in form.names]
        theirs = [getattr(ref, n, None) for n in form.names]
        if all(f is not None for f in ours + theirs) and all(
                _code(getattr(a, "_gw_own", a)) == _code(getattr(b, "_gw_own", b)) for a, b in zip(ours, theirs)):
            return form
    return None


def _prepare_functions(model) -> int:
    """Replace each function form's function in the modules ``model``'s classes come from: how
    many of those modules have it."""
    n = 0
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        form = None if module is None else function_form(module)
        if form is None or not form.available():
            continue
        n += 1
        with _LOCK:
            own = getattr(module, form.names[0])
            if getattr(own, "_gw_own", None) is None:
                setattr(module, form.names[0], form.fused(own))
    return n


def prepare(model) -> int:
    """Replace the ``forward`` of each class of ``model``'s modules that is one of the forms
    (once per class; where this torch has the form's kernel), and each function form's function
    in the modules they come from: how many modules and functions were taken."""
    n = _prepare_functions(model)
    for m in model.modules():
        cls = type(m)
        if cls in _ORIGINAL:
            n += 1
            continue
        form = form_of(cls)
        if form is None or not form.available():
            continue
        n += 1
        with _LOCK:
            if cls not in _ORIGINAL:
                _ORIGINAL[cls] = cls.forward
                cls.forward = form.fused(cls.forward)
    return n
