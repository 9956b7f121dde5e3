"""A Llama-form decoder layer with its two RMSNorms folded into the products that read them.

transformers' ``LlamaDecoderLayer`` (and Mistral's and Qwen2's, instruction for instruction)
norms its input, hands the result to the attention's query, key and value projections and to
nothing else, then norms the attention's sum with the residual and hands that to the gated MLP
and to nothing else. A norm is a kernel of its own (``rms_norm``: 3-4 us on a step's 64 rows,
two a layer), whose output is read once, by the next product. On a step, where :mod:`.qkv` and
:mod:`.mlp` take those products, each of their programs reads its rows' whole input anyway: it
sums the squares of the rows first and norms each tile of the input as it reads it (in fp32,
rounded once to the input's dtype, as ``rms_norm`` writes it), so the normed input is never
written and the norms' kernels are gone.

The layer's own ``forward`` still runs, over :class:`Folded`: the layer as it is, but for its
norms, which give a name for their result (a view of the input, never read), and the two
modules that read it, which take that name to mean "the normed input" and make their products
from the input itself. Any other call goes to the module itself. :func:`fold` builds it where
each half applies (the norm of Llama's form with the states' dtype, the module of the form
:mod:`.fused` takes, no hooks that a direct call would skip) and None where neither does.
"""

from typing import Optional

import torch

from . import mlp, qkv

Tensor = torch.Tensor


class _Slot:
    """What a folded norm was given (``x``) and the name it gave back (``name``)."""
    x: Optional[Tensor] = None
    name: Optional[Tensor] = None


class _Norm:
    """A norm that gives a name for its result instead of the result (``x.view(x.shape)``: the
    input's values, a tensor of its own to be known by)."""

    def __init__(self, norm, slot: _Slot):
        self._norm, self._slot = norm, slot

    def __call__(self, x: Tensor) -> Tensor:
        self._slot.x, self._slot.name = x, x.view(x.shape)
        return self._slot.name

    def __getattr__(self, name):
        return getattr(self._norm, name)


class _Attention:
    """The attention called with the folded norm's name: its own forward over projections made
    from the norm's input in one kernel, normed inside it."""

    def __init__(self, attn, own, norm, slot: _Slot):
        self._attn, self._own, self._norm, self._slot = attn, own, norm, slot

    def __call__(self, *args, **kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)
        name, x = self._slot.name, self._slot.x
        if name is None or x is None or hidden is not name:
            return self._attn(*args, **kwargs)
        ps = [getattr(self._attn, n) for n in qkv.NAMES]
        outs = qkv.project(x, [p.weight for p in ps], [p.bias for p in ps],
                           norm=(self._norm.weight, self._norm.variance_epsilon))
        return self._own(qkv.Given(self._attn, name, outs), *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._attn, name)


class _MLP:
    """The gated MLP called with the folded norm's name: its first half made from the norm's
    input in one kernel, normed inside it, then its down projection."""

    def __init__(self, module, norm, slot: _Slot):
        self._mlp, self._norm, self._slot = module, norm, slot

    def __call__(self, x: Tensor) -> Tensor:
        given = self._slot.x
        if x is not self._slot.name or given is None:
            return self._mlp(x)
        m = self._mlp
        gated = mlp.gate_up(given, m.gate_proj.weight, m.up_proj.weight,
                            norm=(self._norm.weight, self._norm.variance_epsilon))
        return m.down_proj(gated)

    def __getattr__(self, name):
        return getattr(self._mlp, name)


class Folded:
    """A decoder layer as it is, but for the members folded (``input_layernorm`` with
    ``self_attn``, ``post_attention_layernorm`` with ``mlp``, each pair where it applies)."""

    def __init__(self, layer, members: dict):
        object.__setattr__(self, "_gw_layer", layer)
        object.__setattr__(self, "_gw_members", members)

    def __getattr__(self, name):
        members = object.__getattribute__(self, "_gw_members")
        if name in members:
            return members[name]
        return getattr(object.__getattribute__(self, "_gw_layer"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_gw_layer"), name, value)


def _bare(module) -> bool:
    """Whether calling ``module``'s forward directly skips nothing (no hooks of its own or global)."""
    from torch.nn.modules import module as m

    return not (module._forward_hooks or module._forward_pre_hooks or m._global_forward_hooks
                or m._global_forward_pre_hooks)


def _norm_folds(norm, x: Tensor) -> bool:
    """Whether ``norm`` is Llama's RMSNorm (by :mod:`.fused`'s forms) whose weight the kernels take
    inside ``rms_norm``'s one rounding: the states' dtype, one value a feature, on their device."""
    from . import fused

    form = fused.form_of(type(norm))
    w = getattr(norm, "weight", None)
    return (form is not None and form.fused is fused.norm_forward and _bare(norm) and isinstance(w, torch.Tensor)
            and type(w) in (torch.nn.Parameter, torch.Tensor) and w.dtype == x.dtype and w.device == x.device
            and w.dim() == 1 and w.shape[0] == x.shape[-1] and w.stride(0) == 1
            and isinstance(getattr(norm, "variance_epsilon", None), float))


def fold(layer, x: Tensor) -> Optional[Folded]:
    """:class:`Folded` over ``layer`` for its input ``x``, or None where neither half applies."""
    from . import fused

    members: dict = {}
    attn, ln1 = getattr(layer, "self_attn", None), getattr(layer, "input_layernorm", None)
    own = fused.projections_own(type(attn))
    if own is not None and _bare(attn) and _norm_folds(ln1, x) and qkv.applies(
            x, [getattr(attn, n, None) for n in qkv.NAMES]):
        slot = _Slot()
        members.update(input_layernorm=_Norm(ln1, slot), self_attn=_Attention(attn, own, ln1, slot))
    module, ln2 = getattr(layer, "mlp", None), getattr(layer, "post_attention_layernorm", None)
    form = None if module is None else fused.form_of(type(module))
    if (module is not None and form is not None and form.fused is fused.mlp_forward and _bare(module) and _norm_folds(ln2, x)
            and fused.silu(getattr(module, "act_fn", None)) and mlp.applies(x, module.gate_proj, module.up_proj)):
        slot = _Slot()
        members.update(post_attention_layernorm=_Norm(ln2, slot), mlp=_MLP(module, ln2, slot))
    return Folded(layer, members) if members else None
