"""How a call becomes a graph key: its tensor leaves, the dimension of each that holds the batch
and the one that holds the sequence, the batch size ``n`` and length ``L``, and everything else
that shapes a graph (structure, constants, the other dims, dtypes, devices, autocast).

``GraphedModule(batch_dim=, seq_dim=, pad_values=)`` declare the roles; :class:`Declarations`
applies them to each call. Pure Python and torch: runs and is tested on a CPU.
"""

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from ..errors import GraphwrapError
from .reasons import Eager, Kind, input_reason
from .tree import UnsupportedInput, count_tensors, flatten_inputs, render, states_in

logger = logging.getLogger("graphwrap")

Tensor = torch.Tensor
# A leaf's role: (batch dim or None, seq dim or None, pad value). Tuples: read on every call.
Role = Tuple[Optional[int], Optional[int], Any]
DimSpec = Union[None, int, Dict[Union[str, int], Optional[int]]]
_INFER = object()  # a leaf under the default batch_dim: unbatched if it lacks the dim or has 1 row


@dataclass(slots=True)
class Facts:
    """One call, seen as the engine sees it."""

    key: tuple  # hashable: everything that shapes a graph
    leaves: List[Tensor]
    n: int  # rows
    L: Optional[int]  # sequence length, None when no input has a sequence dim
    spec: tuple
    meta: tuple  # per leaf: (shape with "B"/"S" at the batch and sequence dims, dtype, device)
    roles: Tuple[Role, ...]
    autocast: Any
    device: Any = None  # where its graphs run (set by the engine)
    state: bool = False  # an input is state written in place (a static cache): one call, never padded


def _check_dim(name: str, value, allow_none: bool):
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if not ok and not (allow_none and value is None):
        more = ", or None for an input that has none" if allow_none else ""
        raise GraphwrapError(f"{name} must be a non-negative int{more}, got {value!r}")


def _check_spec(name: str, value: DimSpec, default_ok: bool):
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise GraphwrapError(f"{name} keys are input names or positions, got {k!r}")
            _check_dim(f"{name}[{k!r}]", v, allow_none=True)
    elif not (default_ok and value is None):
        _check_dim(name, value, allow_none=False)


def _positional_names(module) -> Tuple[str, ...]:
    """Names of ``module.forward``'s positional parameters, so a declaration by name also
    applies to an input passed by position."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def _check_inputs(module, option: str, keys: list):
    """GraphwrapError for a key of ``option`` that names no input of ``module.forward`` (a name
    it has no parameter of, a position past its positional ones), where its signature says."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return
    P = inspect.Parameter
    names = [p.name for p in params if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    positional = [p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    any_name = any(p.kind == P.VAR_KEYWORD for p in params)
    any_position = any(p.kind == P.VAR_POSITIONAL for p in params)
    for k in keys:
        if isinstance(k, str) and not any_name and k not in names:
            raise GraphwrapError(f"{option} names the input {k!r}, which {type(module).__name__}.forward does not "
                                 f"take: its inputs are {names}")
        if isinstance(k, int) and (k < 0 or (not any_position and k >= len(positional))):
            raise GraphwrapError(f"{option} names input position {k}, which {type(module).__name__}.forward does not "
                                 f"take: it takes {len(positional)} positional inputs ({positional})")


class Declarations:
    """The batch and sequence dims and pad values declared for a module's inputs.

    ``batch_dim``: an int for every tensor input (inputs without that dim, or with one row
    where others have more, count as unbatched), or a dict by input name or position with
    None for an input that is not batched (inputs left out keep the default 0). ``seq_dim``:
    None (no sequence dim), an int for every tensor input that has that dim, or a dict by
    name or position. ``pad_values``: the value sequence padding holds, one for all or a dict
    by name (default 0).
    """

    def __init__(self, module, batch_dim: DimSpec = 0, seq_dim: DimSpec = None, pad_values=0, state=None):
        _check_spec("batch_dim", batch_dim, default_ok=False)
        self.state = _state_names(state)
        _check_spec("seq_dim", seq_dim, default_ok=True)
        if isinstance(batch_dim, int) and isinstance(seq_dim, int) and batch_dim == seq_dim:
            raise GraphwrapError(f"seq_dim={seq_dim} is the batch_dim; the sequence needs a dim of its own")
        if not isinstance(pad_values, (dict, int, float, bool)):
            raise GraphwrapError(f"pad_values must be a number or a dict of numbers by input name, got {pad_values!r}")
        self.batch_dim, self.seq_dim, self.pad_values = batch_dim, seq_dim, pad_values
        self.default_bd = batch_dim if isinstance(batch_dim, int) else 0
        self.positional = _positional_names(module)
        for option, value in (("batch_dim", batch_dim), ("seq_dim", seq_dim), ("pad_values", pad_values)):
            if isinstance(value, dict):
                _check_inputs(module, option, list(value))
        _check_inputs(module, "state", sorted(self.state, key=str))
        self.simple = isinstance(batch_dim, int) and seq_dim is None  # the common case, checked fast
        self.has_seq = seq_dim is not None
        self._declared: Dict[tuple, tuple] = {}  # spec -> per leaf (bd or _INFER-marked, sd, pad)
        # (position or name, type) of a top-level input graphwrap cannot key on -> why: such a
        # call is refused before it is flattened (a model's cache object, passed on every call)
        self._refused: Dict[tuple, Eager] = {}
        self._stateful: Dict[tuple, bool] = {}  # spec -> whether it holds a state input
        self.dims_checked = False

    def forget(self):
        """Drop what was remembered per spec: a spec of a call with state holds that state (a
        decode batch's windows, and through them its cache), which an engine reset lets go of."""
        self._declared.clear()
        self._stateful.clear()

    def check_unkeyed(self, args, kwargs):
        """Where calls get no key (training mode, no CUDA), the dims are checked against the first
        call all the same: a dim no input has raises, as a keyed call would; a call they do not fit
        (a named input without its dim) is logged once, with what keyed calls would run as."""
        if self.dims_checked:
            return
        self.dims_checked = True
        got = self.facts(args, kwargs, None)
        if type(got) is Eager and got.kind is Kind.INPUT:
            logger.warning("%s; where graphs serve this module, such calls run eagerly", got.reason)

    # ------------------------------------------------------------------ per spec, once

    def _lookup(self, table, position, name, default):
        if not isinstance(table, dict):
            return default
        for k in (name, position):
            if k is not None and k in table:
                return table[k]
        return default

    def _owners(self, spec) -> List[Tuple[Optional[int], Optional[str]]]:
        """(position, name) of the top-level input each leaf belongs to."""
        spec_args, spec_kw = spec
        out: List[Tuple[Optional[int], Optional[str]]] = []
        for i, s in enumerate(spec_args):
            name = self.positional[i] if i < len(self.positional) else None
            out += [(i, name)] * count_tensors(s)
        for k, s in spec_kw:
            out += [(None, k)] * count_tensors(s)
        return out

    def _declare(self, spec) -> tuple:
        decl = []
        for pos, name in self._owners(spec):
            bd = self._lookup(self.batch_dim, pos, name, _INFER)
            sd = self._lookup(self.seq_dim, pos, name, self.seq_dim if isinstance(self.seq_dim, int) else None)
            pad = self._lookup(self.pad_values, pos, name, 0 if isinstance(self.pad_values, dict) else self.pad_values)
            decl.append((bd, sd, pad, name if name is not None else f"#{pos}"))
        self._declared[spec] = tuple(decl)
        return self._declared[spec]

    def names(self, spec) -> List[str]:
        """Per leaf, the name (or ``#position``) of the input it belongs to, for messages."""
        decl = self._declared.get(spec) or self._declare(spec)
        return [d[3] for d in decl]

    # ------------------------------------------------------------------ per call

    def facts(self, args, kwargs, autocast, single_spec=None) -> Union[Facts, Eager]:
        """The call's :class:`Facts`, or the :class:`~graphwrap.core.reasons.Eager` reason it runs eagerly."""
        if single_spec is not None and not self.state:
            leaves, spec = [args[0]], single_spec
        else:
            refused = self._refused
            if refused:
                for i, a in enumerate(args):
                    why = refused.get((i, type(a)))
                    if why is not None:
                        return why
                for k, a in kwargs.items():
                    why = refused.get((k, type(a)))
                    if why is not None:
                        return why
            try:
                leaves, spec = flatten_inputs(args, kwargs, self.state, self.positional)
            except UnsupportedInput as e:
                why = input_reason(str(e))
                self._remember_refusal(args, kwargs, e.refused, why)
                return why
        if not leaves:
            return input_reason("the call has no tensor inputs to batch")
        if single_spec is None and _has_state(spec, self._stateful):
            # State fixes the batch: nothing is padded, every input is copied in whole.
            roles = ((None, None, 0),) * len(leaves)
            meta = tuple((tuple(t.shape), t.dtype, t.device) for t in leaves)
            return Facts((spec, meta, autocast), leaves, 1, None, spec, meta, roles, autocast, state=True)
        if self.simple:
            roles = _infer_batch(leaves, self.default_bd)
            if type(roles) is Eager:
                return roles
            roles, n = roles
            L = None
        else:
            got = self._roles(spec, leaves)
            if type(got) is Eager:
                return got
            roles, n, L = got
        if n == 0:
            return input_reason("the batch is empty")
        meta = tuple((_masked(t.shape, r[0], r[1]), t.dtype, t.device) for t, r in zip(leaves, roles))
        return Facts((spec, meta, autocast), leaves, n, L, spec, meta, roles, autocast)

    def _remember_refusal(self, args, kwargs, refused, why: Eager):
        """Keep the reason where a top-level input's own type is what graphwrap cannot key on."""
        if refused is None:
            return
        for i, a in enumerate(args):
            if a is refused:
                self._refused[(i, type(a))] = why
        for k, a in kwargs.items():
            if a is refused:
                self._refused[(k, type(a))] = why

    def _roles(self, spec, leaves):
        decl = self._declared.get(spec) or self._declare(spec)
        inferred = [i for i, d in enumerate(decl) if d[0] is _INFER]
        base = _infer_batch([leaves[i] for i in inferred], self.default_bd) if inferred else ([], None)
        if type(base) is Eager:
            return base
        it = iter(base[0])
        n, L, roles = base[1], None, []
        for i, (t, (bd, sd, pad, name)) in enumerate(zip(leaves, decl)):
            if bd is _INFER:
                bd = next(it)[0]
            elif bd is not None:
                if t.dim() <= bd:
                    return input_reason(f"input {name} has shape {tuple(t.shape)}, with no batch_dim={bd}")
                if n is None:
                    n = t.shape[bd]
                elif t.shape[bd] != n:
                    return input_reason(f"input {name} has {t.shape[bd]} rows along batch_dim={bd} where other inputs "
                                        f"have {n}; declare the inputs that are not batched with batch_dim={{name: None}}")
            if sd is not None and (t.dim() <= sd or sd == bd):
                if isinstance(self.seq_dim, dict) and name in self.seq_dim:
                    return input_reason(f"input {name} has shape {tuple(t.shape)}, with no seq_dim={sd} apart from its batch dim")
                sd = None
            if sd is not None:
                if L is None:
                    L = t.shape[sd]
                elif t.shape[sd] != L:
                    return input_reason(f"inputs disagree on the sequence length along seq_dim: {L} and {t.shape[sd]} "
                                        f"(input {name})")
            roles.append((bd, sd, pad))
        if n is None:
            return input_reason("no input is batched")
        if L is None and isinstance(self.seq_dim, int):
            raise GraphwrapError(f"seq_dim={self.seq_dim}, but no tensor input has a dimension {self.seq_dim} apart from "
                                 f"its batch dim (shapes {[tuple(t.shape) for t in leaves]}); pass the dimension that "
                                 "holds the sequence, e.g. seq_dim=1")
        return tuple(roles), n, L


def state_refs(spec) -> tuple:
    """The state inputs (``state.StateRef``) of a call's spec, in order."""
    return states_in(spec)


def _state_names(state) -> frozenset:
    """``state=`` as a set of input names and positions; GraphwrapError for anything else."""
    if state is None:
        return frozenset()
    items = [state] if isinstance(state, (str, int)) else state
    try:
        items = list(items)
    except TypeError:
        items = None
    if not items or any(not isinstance(x, (str, int)) or isinstance(x, bool) for x in items):
        raise GraphwrapError(f"state must be an input name or position, or a list of them, such as "
                             f'["k_cache", "v_cache"], got {state!r}')
    return frozenset(items)


def _has_state(spec, memo: Dict[tuple, bool]) -> bool:
    got = memo.get(spec)
    if got is None:
        got = memo[spec] = bool(states_in(spec))
    return got


def _infer_batch(leaves, bd: int):
    """Roles and rows for leaves under the default batch dim, or why they cannot be batched.

    Every leaf is batched when all agree on the rows. Otherwise a leaf without the dim, or with
    one row where the others agree on more, is taken as unbatched (broadcast over the batch);
    any other disagreement is ambiguous.
    """
    n = None
    for t in leaves:
        m = t.shape[bd] if t.dim() > bd else -1
        if n is None:
            n = m
        elif m != n:
            break
    else:
        if n != -1:
            return [(bd, None, 0)] * len(leaves), n
    rows = {t.shape[bd] for t in leaves if t.dim() > bd}
    many = rows - {1}
    if len(many) > 1:
        sizes = [tuple(t.shape) for t in leaves]
        return input_reason(f"batched inputs disagree on the batch size along batch_dim={bd} (shapes {sizes}); pass "
                            "batch_dim={name: None, ...} to say which inputs are not batched")
    if not rows:
        if bd > 0:
            raise GraphwrapError(f"batch_dim={bd}, but no tensor input has a dimension {bd} (shapes "
                                 f"{[tuple(t.shape) for t in leaves]}); pass the dimension that holds the batch, "
                                 "e.g. batch_dim=0")
        return input_reason("no input has the batch dim (batch_dim=%d)" % bd)
    n = many.pop() if many else 1
    roles = [(bd, None, 0) if t.dim() > bd and t.shape[bd] == n else (None, None, 0) for t in leaves]
    return roles, n


def _masked(shape, bd, sd) -> tuple:
    """The shape with "B" at the batch dim and "S" at the sequence dim: part of the key."""
    s = tuple(shape)
    if sd is None:
        return s if bd is None else s[:bd] + ("B",) + s[bd + 1:]
    return tuple("B" if i == bd else "S" if i == sd else d for i, d in enumerate(s))


def describe_key(spec, meta, autocast) -> str:
    """A readable input signature: ``(Tensor[B, S] int64 cuda:0, mask=Tensor[B, S] ...)``."""
    spec_args, spec_kw = spec
    it = iter(meta)

    def leaf(s):
        tag = s[0]
        if tag == "T":
            shape, dtype, device = next(it)
            return f"Tensor[{', '.join(str(d) for d in shape)}] {str(dtype).replace('torch.', '')} {device}"
        return repr(s[2]) if tag == "C" else repr(s[1])

    def one(s):
        return render(s, leaf)

    parts = [one(s) for s in spec_args] + [f"{k}={one(s)}" for k, s in spec_kw]
    text = "(" + ", ".join(parts) + ")"
    if autocast is not None:
        text += f" autocast={str(autocast).replace('torch.', '')}"
    return text
