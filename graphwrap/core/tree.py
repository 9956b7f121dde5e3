"""Inputs flattened into tensor leaves and a hashable key; outputs flattened and rebuilt.

Containers that ``torch.utils._pytree`` knows (registered types, namedtuples, Hugging Face
outputs on versions that register them) are taken apart through it. What stays here is what
pytree does not do: a key that holds every non-tensor input by value, so that a graph is only
replayed for the constants it was captured with (pytree treats them as leaves, on some torch
versions with no hash of their value), with NaN made equal to itself and mutable objects
refused (:class:`UnsupportedInput`); dataclasses and mappings that pytree does not register;
and, for outputs, which leaves are tensors and which carry the batch or the length.

Pure Python and torch, no CUDA: everything here runs and is tested on a CPU.
"""

import collections
import dataclasses
import enum
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as _pytree

from ..errors import GraphwrapError
from ..process import DICT_TYPES_REBUILT, REBUILDS_SAME
from .state import INFERENCE_STATE, NOT_STATE, StateRef, state_reason

Tensor = torch.Tensor

# Constants that are immutable, so a graph keyed on their value stays right. A mutable object
# (a config, a list held elsewhere) could change after capture without changing the key.
_CONSTANT_TYPES = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)


class UnsupportedInput(GraphwrapError):
    """An input leaf that is neither a tensor nor an immutable constant; the call runs eagerly.
    ``refused``: the object whose own type is refused (None where its contents are)."""

    def __init__(self, msg: str, refused=None):
        super().__init__(msg)
        self.refused = refused


# Spec nodes. A leaf is ("T",), a tensor input; ("L",), an output leaf; ("C", type, value), a
# constant input; ("S", ref), a state input. A container is always (tag, type, keys, children,
# extra): keys for mappings and dataclasses (None otherwise), extra a defaultdict's factory or a
# registered type's (context, unflatten) (None otherwise). The flatteners below make nodes;
# ``_build`` turns any node back into its object and ``fold`` is every other reader.
_TENSOR = ("T",)
_LEAF_TAGS = frozenset(("T", "L", "C", "S"))


def _const_spec(x):
    if isinstance(x, float) and math.isnan(x):
        return ("C", float, "nan")  # nan != nan would make a new key every call
    return ("C", type(x), x)


def _flatten(obj, leaves: List[Tensor], path: str):
    if isinstance(obj, Tensor):
        leaves.append(obj)
        return _TENSOR
    t = type(obj)
    if t is tuple or t is list:
        return (t.__name__, t, None, tuple(_flatten(v, leaves, f"{path}[{i}]") for i, v in enumerate(obj)), None)
    if isinstance(obj, dict):
        keys = tuple(obj.keys())
        for k in keys:
            if not isinstance(k, _CONSTANT_TYPES):
                raise UnsupportedInput(f"dict key {k!r} at {path} is not a constant graphwrap can key on")
        children = tuple(_flatten(obj[k], leaves, f"{path}[{k!r}]") for k in keys)
        if isinstance(obj, collections.defaultdict):  # its constructor takes the factory first
            return ("defaultdict", t, keys, children, obj.default_factory)
        if t is not dict and not _dict_type_rebuilds(t):
            raise UnsupportedInput(
                f"input at {path} is a {t.__name__}, a dict type that {t.__name__}(items) does not rebuild"
            )
        return ("dict", t, keys, children, None)
    if isinstance(obj, tuple):  # namedtuple and other tuple subclasses
        return ("tuple+", t, None, tuple(_flatten(v, leaves, f"{path}[{i}]") for i, v in enumerate(obj)), None)
    if isinstance(obj, list):
        return ("list+", t, None, tuple(_flatten(v, leaves, f"{path}[{i}]") for i, v in enumerate(obj)), None)
    if isinstance(obj, _CONSTANT_TYPES):
        return _const_spec(obj)
    why = state_reason(obj)
    if why is None:  # state the forward writes in place (a static cache): used where it lives
        ref = StateRef(obj)
        if ref.inference:
            raise UnsupportedInput(INFERENCE_STATE)
        return ("S", ref)
    if why is not NOT_STATE:
        raise UnsupportedInput(why)
    raise UnsupportedInput(
        f"input at {path} has type {t.__name__}, which is neither a tensor nor an immutable constant "
        "(int, float, bool, str, None, torch.dtype, torch.device, an Enum)", refused=obj
    )




def _dict_type_rebuilds(t: type) -> bool:
    """Whether ``t(items)`` gives back a ``t`` with those items (asked once per type)."""
    ok = DICT_TYPES_REBUILT.get(t)
    if ok is None:
        try:
            probe = t({"graphwrap": 1})
            ok = type(probe) is t and dict(probe) == {"graphwrap": 1}  # type: ignore[call-overload]
        except Exception:  # noqa: BLE001 - whatever the constructor raises
            ok = False
        DICT_TYPES_REBUILT[t] = ok
    return ok


def flatten_inputs(args: tuple, kwargs: dict, state=frozenset(), positional=()) -> Tuple[List[Tensor], tuple]:
    """Tensor leaves of ``(args, kwargs)`` in order, and a hashable spec of everything else.

    The spec holds the tree structure and every constant, so two calls with the same spec and
    the same tensor metadata run the same graph. Top-level inputs named in ``state`` (by name,
    or position; ``positional`` names the forward's positional parameters) are state: kept in
    the spec as they are (``StateRef``), their tensors no leaves.
    """
    leaves: List[Tensor] = []
    if state:
        spec_args = tuple(_declared_state(v, f"args[{i}]") if i in state or (i < len(positional) and positional[i] in state)
                          else _flatten(v, leaves, f"args[{i}]") for i, v in enumerate(args))
        spec_kw = tuple((k, _declared_state(v, f"kwargs[{k!r}]") if k in state else _flatten(v, leaves, f"kwargs[{k!r}]"))
                        for k, v in kwargs.items())
        return leaves, (spec_args, spec_kw)
    spec_args = tuple(_flatten(v, leaves, f"args[{i}]") for i, v in enumerate(args))
    if kwargs:
        spec_kw = tuple((k, _flatten(kwargs[k], leaves, f"kwargs[{k!r}]")) for k in kwargs)
    else:
        spec_kw = ()
    return leaves, (spec_args, spec_kw)


def _declared_state(obj, path: str):
    """The spec of an input named in ``state=``: the object itself, keyed on its tensors."""
    ref = StateRef(obj)
    if not ref.ptrs:
        raise UnsupportedInput(f"input at {path} is named in state= but holds no tensor")
    if ref.inference:
        raise UnsupportedInput(INFERENCE_STATE)
    return ("S", ref)


def _build(node, it):
    """The object a spec node stands for, its leaves taken in order from ``it``: the one builder
    of input and output nodes."""
    tag = node[0]
    if tag == "T" or tag == "L":
        return next(it)
    if tag == "C":
        return float("nan") if node[2] == "nan" and node[1] is float else node[2]
    if tag == "S":
        return node[1].obj
    _, t, keys, children, extra = node
    if tag == "tuple":
        return tuple([_build(c, it) for c in children])
    if tag == "list":
        return [_build(c, it) for c in children]
    if tag == "dict":
        d = {k: _build(c, it) for k, c in zip(keys, children)}
        return d if t is dict else t(d)
    if tag == "defaultdict":
        return t(extra, {k: _build(c, it) for k, c in zip(keys, children)})
    if tag == "tuple+":
        vals = [_build(c, it) for c in children]
        return t(*vals) if hasattr(t, "_fields") else t(vals)
    if tag == "list+":
        return t([_build(c, it) for c in children])
    if tag == "dc" or tag == "dcmap":
        return t(**{k: _build(c, it) for k, c in zip(keys, children)})
    if tag == "pytree":
        context, unflatten = extra
        return unflatten([_build(c, it) for c in children], context.value)
    raise AssertionError(f"unknown spec node {tag!r}")


def fold(node, leaf: Callable, branch: Callable):
    """Every reader of spec nodes but the builder: ``leaf(node)`` for a leaf, ``branch(node,
    values)`` for a container with its children's values in order (left to right, bottom up)."""
    if node[0] in _LEAF_TAGS:
        return leaf(node)
    return branch(node, [fold(c, leaf, branch) for c in node[3]])


def count_tensors(node) -> int:
    """The tensor inputs a spec node holds."""
    return fold(node, lambda n: n[0] == "T", lambda n, vals: sum(vals))


def states_in(spec) -> tuple:
    """The state inputs (``state.StateRef``) of an input spec, in order."""
    spec_args, spec_kw = spec
    nodes = list(spec_args) + [s for _, s in spec_kw]
    return tuple(r for s in nodes for r in fold(s, lambda n: (n[1],) if n[0] == "S" else (),
                                                  lambda n, vals: tuple(x for v in vals for x in v)))


def render(node, leaf: Callable[[tuple], str]) -> str:
    """A spec node as text, each leaf as ``leaf(node)`` says, containers as Python writes them."""
    def branch(n, vals):
        tag, t, keys = n[0], n[1], n[2]
        if tag == "tuple":
            return "(" + ", ".join(vals) + ")"
        if tag == "list":
            return "[" + ", ".join(vals) + "]"
        if keys is not None:
            inner = "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(keys, vals)) + "}"
            return inner if t is dict else f"{t.__name__}({inner})"
        return f"{t.__name__}(" + ", ".join(vals) + ")"
    return fold(node, leaf, branch)


def _label(node, i: int) -> str:
    """The path step from a container node to its child ``i``, for messages."""
    tag, t, keys = node[0], node[1], node[2]
    if tag == "dc":
        return f".{keys[i]}"
    if keys is not None:
        return f"[{keys[i]!r}]"
    if tag == "tuple+" and hasattr(t, "_fields"):
        return f".{t._fields[i]}"
    if tag == "pytree":
        return f"<{t.__name__} child {i}>"
    return f"[{i}]"


def _paths(node, prefix: str) -> List[str]:
    """The path of every leaf of an output node, in order."""
    tails = fold(node, lambda n: [""], lambda n, vals: [_label(n, i) + p for i, v in enumerate(vals) for p in v])
    return [prefix + p for p in tails]


def unflatten_inputs(spec: tuple, leaves: Sequence[Tensor]) -> Tuple[tuple, dict]:
    """Rebuild ``(args, kwargs)`` from a spec and tensor leaves (the inverse of flatten_inputs)."""
    it = iter(leaves)
    spec_args, spec_kw = spec
    args = tuple(_build(s, it) for s in spec_args)
    kwargs = {k: _build(s, it) for k, s in spec_kw}
    return args, kwargs


def _registered(t: type):
    """``(flatten_fn, unflatten_fn)`` of a type registered with ``torch.utils._pytree``, or None."""
    node = _pytree.SUPPORTED_NODES.get(t)
    if node is None:
        return None
    return node.flatten_fn, node.unflatten_fn




def _looked_into(obj):
    """``(children, context, unflatten)`` of an object whose type is registered with
    ``torch.utils._pytree`` and rebuilt as that type by its registration; else None.

    Containers graphwrap knows (tuples, lists, dicts, dataclasses, namedtuples) are handled
    before this is asked; other registered types (a model's cache object, say) are looked into,
    so the tensors they hold are outputs like any other. A registration that rebuilds another
    type (torch.Size comes back a tuple) is not used: the object stays as it is. Whether it
    does is tried once per type (a trial rebuild of a large cache costs milliseconds).
    """
    t = type(obj)
    reg = _registered(t)
    if reg is None:
        return None
    children, context = reg[0](obj)
    children = list(children)
    same = REBUILDS_SAME.get(t)
    if same is None:
        try:
            same = type(reg[1](children, context)) is t
        except Exception:  # noqa: BLE001 - a registration that cannot rebuild it is not used
            same = False
        REBUILDS_SAME[t] = same
    return (children, context, reg[1]) if same else None


class _Context:
    """A registered type's flatten context in an output spec: compared by value, never hashed
    by it (contexts are often lists)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        if not isinstance(other, _Context):
            return NotImplemented
        try:
            return bool(self.value == other.value)
        except Exception:  # noqa: BLE001 - contexts that cannot be compared are not the same
            return False

    def __hash__(self):
        return hash(type(self.value))

    def __repr__(self):
        return f"_Context({self.value!r})"


def map_tensors(fn: Callable[[Tensor], Any], obj):
    """``obj`` with ``fn`` applied to every tensor in it, rebuilt as outputs are: tuples, lists,
    dicts, dataclasses, namedtuples and types registered with ``torch.utils._pytree``; ``obj``
    itself where ``fn`` changed nothing. Raises GraphwrapError where the rebuilt object would not
    hold what ``obj`` held (a container whose constructor takes other arguments)."""
    leaves, spec = flatten_outputs(obj)
    mapped = [fn(x) if isinstance(x, Tensor) else x for x in leaves]
    if all(a is b for a, b in zip(mapped, leaves)):
        return obj
    out = spec.rebuild(mapped)
    back = flatten_outputs(out)[1]
    if back != spec:
        raise GraphwrapError(
            f"{spec.first_difference(back, 'the object')} is not there once the object is rebuilt from its parts "
            "(a container whose constructor takes other arguments than its contents?), so graphwrap cannot "
            "give it back with its tensors moved or cut"
        )
    return out


def to_device_shallow(obj, device):
    """``obj`` with its CPU tensors moved to ``device``, looking into tuples, lists and dicts only
    (a model's cache object and other containers are passed as they are: the module gets them as
    given); ``obj`` itself wherever nothing moved."""
    if device.type == "cpu" or not _host_tensor_in(obj):
        return obj
    return _moved(obj, device)


def _host_tensor_in(obj) -> bool:
    if isinstance(obj, Tensor):
        return obj.device.type == "cpu"
    t = type(obj)
    if t is tuple or t is list:
        return any(map(_host_tensor_in, obj))
    if t is dict:
        return any(map(_host_tensor_in, obj.values()))
    return False


def _moved(obj, device):
    if isinstance(obj, Tensor):
        return obj.to(device) if obj.device.type == "cpu" else obj
    t = type(obj)
    if t is tuple or t is list:
        return t(_moved(v, device) for v in obj)
    if t is dict:
        return {k: _moved(v, device) for k, v in obj.items()}
    return obj


def requires_grad_shallow(obj) -> bool:
    """Whether a tensor in ``obj`` (tuples, lists and dicts looked into) requires grad."""
    if isinstance(obj, Tensor):
        return obj.requires_grad
    t = type(obj)
    if t is tuple or t is list:
        return any(requires_grad_shallow(v) for v in obj)
    if t is dict:
        return any(requires_grad_shallow(v) for v in obj.values())
    return False


# ----------------------------------------------------------------------------------------- outputs


class OutputSpec:
    """How to rebuild a module's output from its flat leaves (tensors and other values)."""

    __slots__ = ("node", "num_leaves", "single")

    def __init__(self, node, num_leaves: int):
        self.node = node
        self.num_leaves = num_leaves
        self.single = node == ("L",)

    def rebuild(self, leaves: Sequence[Any]):
        if self.single:
            return leaves[0]
        return _build(self.node, iter(leaves))

    def __eq__(self, other):
        return isinstance(other, OutputSpec) and self.node == other.node

    def __hash__(self):
        return hash(self.node)

    def describe(self, i: int) -> str:
        """A readable path to leaf ``i``, for messages."""
        paths = _paths(self.node, "out")
        return paths[i] if i < len(paths) else f"leaf {i}"

    def first_difference(self, other: "OutputSpec", name: str = "out") -> str:
        """The path of the first leaf of this spec that ``other`` lacks or has elsewhere."""
        mine, theirs = _paths(self.node, name), _paths(other.node, name)
        for i, p in enumerate(mine):
            if i >= len(theirs) or theirs[i] != p:
                return p
        return name


def _dataclass_fields(obj):
    return [f.name for f in dataclasses.fields(obj) if f.init]


def _flatten_out(obj, leaves: list):
    if isinstance(obj, Tensor):
        leaves.append(obj)
        return ("L",)
    t = type(obj)
    if t is tuple or t is list:
        return (t.__name__, t, None, tuple(_flatten_out(v, leaves) for v in obj), None)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if isinstance(obj, dict):
            # HF ModelOutput: a dataclass and an OrderedDict whose keys are the fields set.
            keys = tuple(obj.keys())
            return ("dcmap", t, keys, tuple(_flatten_out(obj[k], leaves) for k in keys), None)
        names = tuple(_dataclass_fields(obj))
        return ("dc", t, names, tuple(_flatten_out(getattr(obj, k), leaves) for k in names), None)
    if isinstance(obj, collections.defaultdict):  # its constructor takes the factory first
        keys = tuple(obj.keys())
        return ("defaultdict", t, keys, tuple(_flatten_out(obj[k], leaves) for k in keys), obj.default_factory)
    if state_reason(obj) is None:  # a state input handed back (a model's cache): the object itself
        leaves.append(obj)
        return ("L",)
    node = None if t is dict or t is collections.OrderedDict else _looked_into(obj)
    if node is not None:
        # A registered type: a model's cache object, say
        children, context, unflatten = node
        return ("pytree", t, None, tuple(_flatten_out(v, leaves) for v in children), (_Context(context), unflatten))
    if isinstance(obj, dict):
        keys = tuple(obj.keys())
        return ("dict", t, keys, tuple(_flatten_out(obj[k], leaves) for k in keys), None)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return ("tuple+", t, None, tuple(_flatten_out(v, leaves) for v in obj), None)
    leaves.append(obj)
    return ("L",)


def flatten_outputs(out) -> Tuple[list, OutputSpec]:
    """Leaves of a module output (tensors and any other values) and the spec that rebuilds it.

    Tuples, lists, namedtuples, dicts, dataclasses and HF-style ModelOutput keep their type;
    so does any other type registered with ``torch.utils._pytree``, rebuilt by its registration.
    """
    leaves: list = []
    node = _flatten_out(out, leaves)
    return leaves, OutputSpec(node, len(leaves))


# Output leaf kinds, decided once per key by comparing outputs at two batch sizes.
BATCHED = "batched"  # a tensor with the batch along batch_dim: cut back to the real rows
WHOLE = "whole"  # a tensor that does not change with the batch: returned whole
CONST = "const"  # a non-tensor value that does not change with the batch: returned as is


def classify_outputs(
    leaves_a: Sequence[Any], n_a: int, leaves_b: Sequence[Any], n_b: int, batch_dim: int, spec: OutputSpec,
    L_a: Optional[int] = None, L_b: Optional[int] = None,
) -> Tuple[List[str], List[Tuple[int, ...]], Dict[int, str]]:
    """Which output leaves are batched and which dims carry the sequence, from one output at
    ``n_a`` rows (length ``L_a``) and one at ``n_b`` rows (length ``L_b``).

    Returns the kinds, the sequence dims of each leaf and, for leaves graphwrap cannot serve
    from a padded graph, the reason (keyed by leaf index). A leaf is batched when its size
    along batch_dim is the batch size in both outputs; a dim carries the sequence when its
    size is the length in both; every other dim must be the same in both.
    """
    if n_a == n_b:
        raise ValueError("classify_outputs needs two different batch sizes")
    kinds: List[str] = []
    seq_dims: List[Tuple[int, ...]] = []
    problems: Dict[int, str] = {}
    for i, (a, b) in enumerate(zip(leaves_a, leaves_b)):
        where = spec.describe(i)
        if isinstance(a, Tensor) and isinstance(b, Tensor):
            kind, dims, problem = _classify_tensor(tuple(a.shape), n_a, L_a, tuple(b.shape), n_b, L_b, batch_dim)
            kinds.append(kind)
            seq_dims.append(dims)
            if problem:
                problems[i] = f"output {where} {problem}"
            continue
        kinds.append(CONST)
        seq_dims.append(())
        if isinstance(a, Tensor) or isinstance(b, Tensor):
            problems[i] = f"output {where} is a tensor at one batch size and not at another"
            continue
        try:
            same = bool(a == b)
        except Exception:  # noqa: BLE001 - any comparison failure means "can't prove it constant"
            same = False
        if not same:
            problems[i] = _changing_constant(a, b, n_a, n_b, where)
    return kinds, seq_dims, problems


def _classify_tensor(sa, n_a, L_a, sb, n_b, L_b, bd):
    """``(kind, seq dims, problem or None)`` of one tensor output seen at two shapes."""
    if len(sa) != len(sb):
        return WHOLE, (), f"has shape {sa} at batch {n_a} but {sb} at batch {n_b}: its rank changes"
    batched = len(sa) > bd and sa[bd] == n_a and sb[bd] == n_b
    dims = tuple(d for d in range(len(sa)) if not (batched and d == bd) and L_a is not None and L_a != L_b
                 and sa[d] == L_a and sb[d] == L_b)
    rest = [d for d in range(len(sa)) if d not in dims and not (batched and d == bd)]
    if all(sa[d] == sb[d] for d in rest):
        return (BATCHED if batched else WHOLE), dims, None
    along = f"batch_dim={bd}" + (" or the sequence" if L_a is not None else "")
    return WHOLE, (), (f"has shape {sa} at batch {n_a} but {sb} at batch {n_b}: it changes with the batch "
                       f"size but not along {along}, so padding cannot be cut off it")


def _changing_constant(a, b, n_a, n_b, where) -> str:
    text = (f"output {where} is {_short(a)} at batch {n_a} but {_short(b)} at batch {n_b}: a non-tensor "
            "output that depends on the batch cannot come from a graph captured at a padded size")
    if not isinstance(a, _CONSTANT_TYPES):
        text += (f". graphwrap cannot look inside a {type(a).__name__}: if it holds tensors, register "
                 "its type with torch.utils._pytree.register_pytree_node and graphwrap returns it "
                 "rebuilt around its tensors, or leave it out of the output")
        if type(a).__name__ == "DynamicCache":
            text += (" (for transformers' DynamicCache: call transformers.integrations.executorch."
                     "register_dynamic_cache_export_support() once, or pass use_cache=False)")
    return text


def _short(x, limit: int = 80) -> str:
    """``repr(x)``, cut to ``limit`` characters."""
    try:
        text = repr(x)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real message
        text = f"<{type(x).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
