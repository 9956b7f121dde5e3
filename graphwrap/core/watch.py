"""What a graph depends on besides its inputs, and the per-call check that it is unchanged.

A graph replays what the module did when it was captured: the tensors it read (at their
addresses), the submodules it ran, their training flags, the forward hooks that ran with them
and the default dtype. :class:`Watch` records these when graphs are first captured and tells
the engine when one of them changed, so the graphs are dropped and captured again before the
next replay.

The per-call check reads counters, not the module tree: one that PyTorch's global registration
hooks and ``nn.Module.train`` bump (a parameter, buffer or submodule assigned on a module of a
watched tree, a training flag set through ``train()``/``eval()``), the id of the last hook handle PyTorch made
(every hook registration makes one), the default dtype, the lengths of the hook tables that
held hooks at capture (a removal), and the tensors' addresses. Only when a counter moved is the
tree read again and compared with the one the graphs were captured with.

Plain attributes: once graphs exist, the attributes the forward read in each capture's reference
run (``reads_recorded``) are watched, on the module, its submodules and the plain objects they hold
(a Hugging Face ``config``, and objects it holds in turn). ``nn.Module.__setattr__``, and
``__setattr__`` of each watched object's class, bump the counter when one of them is assigned,
so the per-call check stays the same few comparisons; the values are read and compared only
then. Attributes the forward assigns itself (a cache or counter kept in
Python), seen while graphwrap runs the forward at capture, are not watched: a replay runs no
Python, so they keep the values the capture left.

Not seen: hook tables edited by hand, lists and dicts changed in place
(``model.opts["scale"] = 2``), and objects whose class cannot take a ``__setattr__`` (built-in and
extension types). Those are frozen into the graphs: call ``gm.reset()`` after changing them.
"""

import contextlib
import functools
import threading
import types
import weakref
from typing import Any, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.modules import module as _nn_module
from torch.utils.hooks import RemovableHandle

from .. import _compat
from ..process import CAPTURE_LOCK, FOLLOWED, FORWARD_RUNS, GENERATION, WATCH_INSTALLED, WATCHED
from .reasons import Eager, Kind

Tensor = torch.Tensor
_data_ptr = Tensor.data_ptr
_default_dtype = torch.get_default_dtype
# GENERATION is bumped whenever a module of a watched tree gets a new parameter, buffer or
# submodule, and by every train(): a Watch re-reads its module when it sees a new value.
# Whether each tensor still has the data pointer recorded for it: one C++ loop (CUDA builds).
_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
# The hook tables a forward runs: per module, and for every module at once. A global forward
# hook runs for every module a forward calls, which no replay can do: while one is registered,
# calls run eagerly (GraphedModule.forward), and the graphs stay for when it is gone.
_compiling = torch.compiler.is_compiling
HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks")
GLOBAL_TABLES = tuple(getattr(_nn_module, n) for n in ("_global_forward_pre_hooks", "_global_forward_hooks")
                      if hasattr(_nn_module, n))


def _bump(module, *_args):
    # Only a registration on a module of a watched tree: one on any other module changes no tree
    # (a ModuleList that a forward slices from its own, as transformers' Llama does on every call,
    # registers each layer again; counted, each engine read its whole tree again on its next call).
    # Not while torch.compile traces a forward: a registration there is the forward's own, and
    # counted it would put the counter in dynamo's guards, so that every call recompiled until
    # dynamo gave up and ran the model eagerly, in any process that had imported graphwrap's hooks.
    if FOLLOWED.get(id(module)) is module and not _compiling():
        GENERATION[0] += 1


def follow(modules):
    """Registrations on these modules (a tree some engine or batch depends on) move the counter
    from now on; a module attached to one of them later is followed when its tree is read again,
    which that registration brings about."""
    for m in modules:
        if FOLLOWED.get(id(m)) is not m:
            FOLLOWED[id(m)] = m


def _assigned(obj, name: str):
    """An attribute of ``obj`` was assigned: a change of what graphs depend on if ``obj`` is
    watched, unless the forward assigns it itself (learned while graphwrap runs the forward)."""
    entry = WATCHED.get(id(obj))
    if entry is None or entry[0]() is not obj:
        return
    if getattr(FORWARD_RUNS, "depth", 0):
        entry[1].add(name)
    elif name in entry[2] and name not in entry[1]:
        GENERATION[0] += 1


@contextlib.contextmanager
def forward_runs():
    """graphwrap runs the forward in this thread (a capture and its checks): attributes it
    assigns meanwhile are the forward's own."""
    FORWARD_RUNS.depth = getattr(FORWARD_RUNS, "depth", 0) + 1
    try:
        yield
    finally:
        FORWARD_RUNS.depth -= 1


def _counted_setattr(cls) -> bool:
    """Wrap ``cls.__setattr__`` once so that assignments on watched instances are counted;
    whether the class counts them (built-in and extension types cannot be wrapped)."""
    if cls.__dict__.get("_graphwrap_counts_setattr", False):
        return True
    setattr_ = cls.__setattr__

    @functools.wraps(setattr_)
    def counted(self, name, value):
        setattr_(self, name, value)
        _assigned(self, name)
    try:
        cls.__setattr__ = counted
        cls._graphwrap_counts_setattr = True
    except (TypeError, AttributeError):
        return False
    return True


_MODULE_OWN = frozenset(nn.Module().__dict__) | {"training"}  # nn.Module's bookkeeping; flags are read apart
_SIMPLE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
_NESTED = 2  # plain objects watched this deep below a module (a config, and the configs it holds)


def _simple(v) -> bool:
    if isinstance(v, _SIMPLE):
        return True
    return type(v) in (tuple, frozenset) and all(isinstance(x, _SIMPLE) for x in v)


def _plain_object(v) -> bool:
    """An object whose attributes a forward may read, watched like a module: instances of
    Python classes with a ``__dict__`` (a config), not tensors, modules, functions or types."""
    if isinstance(v, (Tensor, nn.Module, type)) or callable(v) or not hasattr(v, "__dict__"):
        return False
    return type(v).__module__ != "builtins"


class Attrs:
    """The plain attributes of one object when graphs were captured: simple values by value,
    other objects by identity, plain objects held (to ``_NESTED`` levels) by their own attributes."""

    __slots__ = ("obj", "items")

    def __init__(self, obj, depth: int, seen: dict):
        self.obj = obj
        module = isinstance(obj, nn.Module)
        items: List[Tuple[str, Any, Optional[Attrs]]] = []
        for k, v in vars(obj).items():
            if (module and k in _MODULE_OWN) or isinstance(v, (Tensor, nn.Module)):
                continue
            if _simple(v):
                items.append((k, v, None))
            elif depth < _NESTED and _plain_object(v) and _watch(v):
                sub = seen.get(id(v))
                if sub is None:
                    sub = seen[id(v)] = Attrs(v, depth + 1, seen)
                items.append((k, v, sub))
            else:
                items.append((k, v, None))
        self.items = tuple(items)

    def difference(self, now: "Attrs", where: str) -> Optional[str]:
        watched = _watched_names(self.obj)
        mine = {k: (v, sub) for k, v, sub in self.items if k in watched}
        theirs = {k: (v, sub) for k, v, sub in now.items if k in watched}
        for k in mine.keys() | theirs.keys():
            if k not in mine or k not in theirs:
                return f"attribute {k!r} of {where} was {'added' if k in theirs else 'deleted'}"
            (a, sa), (b, sb) = mine[k], theirs[k]
            if a is b or (_simple(a) and type(a) is type(b) and a == b) or _same_code(a, b):
                if sa is not None and sb is not None:
                    why = sa.difference(sb, f"{where}.{k}")
                    if why is not None:
                        return why
                continue
            return f"attribute {k!r} of {where} changed from {_short(a)} to {_short(b)}"
        return None


def _same_code(a, b) -> bool:
    """Functions made again from the same code (a library that assigns a new closure per call,
    as transformers' ``generate`` does with ``get_compiled_call``), or methods of them on the
    same object, count as the same: what they run is the same code."""
    if isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType):
        return a.__code__ is b.__code__
    if isinstance(a, types.MethodType) and isinstance(b, types.MethodType):
        return a.__self__ is b.__self__ and _same_code(a.__func__, b.__func__)
    return False


def _short(v) -> str:
    text = repr(v) if _simple(v) else f"a {type(v).__name__}"
    return text if len(text) <= 40 else text[:37] + "..."


def _watch(obj) -> bool:
    """Count assignments on ``obj`` from now on; whether they can be counted."""
    key = id(obj)
    entry = WATCHED.get(key)
    if entry is not None and entry[0]() is obj:
        return True
    try:
        ref = weakref.ref(obj, functools.partial(_unwatch, key))
    except TypeError:  # not weakly referable: never watched
        return False
    if not isinstance(obj, nn.Module) and not _counted_setattr(type(obj)):
        return False
    WATCHED[key] = (ref, set(), set())
    return True


def _unwatch(key: int, ref):
    entry = WATCHED.get(key)
    if entry is not None and entry[0] is ref:
        del WATCHED[key]


def _watched_names(obj) -> frozenset:
    """The attributes of ``obj`` the forward read at capture and does not assign itself."""
    entry = WATCHED.get(id(obj))
    return frozenset(entry[2] - entry[1]) if entry is not None and entry[0]() is obj else frozenset()


@contextlib.contextmanager
def reads_recorded():
    """While it lasts, the attributes of watched objects that this thread reads are noted as
    watched (the forward's reads, in a capture's reference run). Their classes'
    ``__getattribute__`` is wrapped for that run only. Two such runs never overlap (the capture
    lock, which a GPU capture holds already): the second would take the first's wrapper for the
    class's own and put it back at its end, for good."""
    with CAPTURE_LOCK:
        with _wrapped_reads():
            yield


@contextlib.contextmanager
def _wrapped_reads():
    me = threading.get_ident()
    classes = [nn.Module]
    for ref, _written, _read in list(WATCHED.values()):
        o = ref()
        if o is not None and not isinstance(o, nn.Module) and type(o) not in classes:
            classes.append(type(o))
    undo = []
    for cls in classes:
        own = cls.__dict__.get("__getattribute__")
        getattribute_ = cls.__getattribute__

        def noting(self, name, _get=getattribute_):
            if threading.get_ident() == me:
                entry = WATCHED.get(id(self))
                if entry is not None:
                    entry[2].add(name)
            return _get(self, name)
        try:
            cls.__getattribute__ = noting  # type: ignore[method-assign]
        except (TypeError, AttributeError):
            continue
        undo.append((cls, own))
    try:
        yield
    finally:
        for cls, own in reversed(undo):
            if own is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = own


def install_hooks():
    """PyTorch's global registration hooks, and ``nn.Module.train`` wrapped to bump the counter
    (once per process; the wrapper calls the original and returns what it returns)."""
    if WATCH_INSTALLED:
        return
    for register in _compat.registration_hooks():
        WATCH_INSTALLED.append(register(_bump))
    train = nn.Module.train
    if not getattr(train, "_graphwrap_counts", False):
        @functools.wraps(train)
        def counted_train(self, mode: bool = True):
            GENERATION[0] += 1
            return train(self, mode)
        setattr(counted_train, "_graphwrap_counts", True)
        nn.Module.train = counted_train  # type: ignore[method-assign]
    _counted_setattr(nn.Module)
    WATCH_INSTALLED.append(True)


class Tree:
    """The module tree as a forward sees it: its submodules, their training flags and forward
    hooks, and the default dtype."""

    __slots__ = ("names", "modules", "flags", "hooks", "dtype", "attrs")

    def __init__(self, module: nn.Module, attrs: bool = False):
        named = list(module.named_modules())
        self.names = tuple(n for n, _ in named)
        self.modules = tuple(m for _, m in named)
        follow(self.modules)
        self.flags = tuple(m.training for m in self.modules)
        self.hooks = tuple(tuple(tuple(getattr(m, t, {})) for t in HOOK_TABLES) for m in self.modules)
        self.dtype = _default_dtype()
        self.attrs = None
        if attrs:  # only where graphs exist or are about to: read once per change, not per call
            seen: dict = {}
            self.attrs = tuple(Attrs(m, 0, seen) if _watch(m) else None for m in self.modules)

    def name(self, i: int) -> str:
        return f"submodule {self.names[i]!r}" if self.names[i] else "the module"

    def training(self) -> Optional[str]:
        """Why calls run eagerly: a submodule in training mode (the top module's flag is read
        on every call)."""
        for i, flag in enumerate(self.flags):
            if flag and i:
                return f"{self.name(i)} is in training mode (call .eval() on it for graphs)"
        return None

    def hooked(self) -> List[str]:
        return [self.name(i) for i, h in enumerate(self.hooks) if any(h)]

    def sized(self) -> Optional[tuple]:
        """The hook tables that hold hooks, with their lengths: a removal shortens one."""
        tables = [getattr(m, t) for m, h in zip(self.modules, self.hooks) if any(h) for t in HOOK_TABLES]
        return tuple((d, len(d)) for d in tables) or None

    def difference(self, now: "Tree") -> Optional[str]:
        """What changed from this tree (the graphs') to ``now``, in words; None if nothing."""
        if self.modules != now.modules:
            if self.names == now.names:
                i = next(i for i, (a, b) in enumerate(zip(self.modules, now.modules)) if a is not b)
                return f"{self.name(i)} was replaced"
            return "submodules were added or removed"
        if self.flags != now.flags:
            i = next(i for i, (a, b) in enumerate(zip(self.flags, now.flags)) if a != b)
            return f"{self.name(i)} was put in {'training' if now.flags[i] else 'eval'} mode"
        if self.hooks != now.hooks:
            i = next(i for i, (a, b) in enumerate(zip(self.hooks, now.hooks)) if a != b)
            return f"a forward hook was added to or removed from {self.name(i)}"
        if self.dtype != now.dtype:
            return f"the default dtype changed from {self.dtype} to {now.dtype}"
        if self.attrs is not None and now.attrs is not None:
            for i, (a, b) in enumerate(zip(self.attrs, now.attrs)):
                if a is not None and b is not None:
                    why = a.difference(b, self.name(i))
                    if why is not None:
                        return why
        return None


class Watch:
    """The module's tensors and tree, and once graphs exist, what they were captured with."""

    __slots__ = ("module", "gen", "hid", "dtype", "sized", "tensors", "ptrs", "ptr_list", "ptr_idx", "keepalive",
                 "captured", "eager")

    def __init__(self, module):
        install_hooks()
        self.module = module
        self.tensors: List[Tensor] = []
        self.ptrs: Optional[tuple] = None
        self.ptr_list = self.ptr_idx = self.keepalive = None
        self.captured: Optional[Tree] = None  # the tree the graphs were captured with
        self.eager: Optional[Eager] = None  # why calls run eagerly (a submodule in training mode), from the last look
        self.sized = None
        self.gen = self.hid = -1
        self.dtype = None

    def unmoved(self) -> bool:
        """Whether every parameter and buffer is where it was when the graphs were captured."""
        if _ptrs_equal is not None:
            return _ptrs_equal(self.tensors, self.ptr_list, self.ptr_idx)
        return tuple(map(_data_ptr, self.tensors)) == self.ptrs

    def current(self) -> bool:
        """The per-call check of a call that replays: no counter moved, no tensor moved."""
        return (GENERATION[0] == self.gen and RemovableHandle.next_id == self.hid and _default_dtype() is self.dtype
                and (self.sized is None or all(len(d) == n for d, n in self.sized)) and self.unmoved())

    def look(self) -> Optional[str]:
        """The check of the general call path: why the graphs must go (in words), or None. Reads
        the tree again where a counter moved, and updates :attr:`eager`."""
        if not (GENERATION[0] == self.gen and RemovableHandle.next_id == self.hid and _default_dtype() is self.dtype
                and (self.sized is None or all(len(d) == n for d, n in self.sized))):
            tree = self._refresh()
            if self.captured is not None:
                why = self.captured.difference(tree)
                if why is not None:
                    return why
        if self.ptrs is not None and (len(self.tensors) != len(self.ptrs) or not self.unmoved()):
            return "the module's parameters or buffers were replaced or moved"
        return None

    def _refresh(self, attrs: bool = False) -> Tree:
        self.gen, self.hid, self.dtype = GENERATION[0], RemovableHandle.next_id, _default_dtype()
        self.tensors = list(self.module.parameters()) + list(self.module.buffers())
        tree = Tree(self.module, attrs or self.captured is not None)
        self.sized = tree.sized()
        why = tree.training()
        self.eager = None if why is None else Eager(why, Kind.GRAD)
        return tree

    def record(self) -> Tree:
        """What the graphs are about to be captured with; the tensors kept alive, so no graph
        ever replays on freed memory."""
        tree = self._refresh(attrs=True)
        self.captured = tree
        self.keepalive = list(self.tensors)
        self.ptr_list = [t.data_ptr() for t in self.tensors]
        self.ptrs = tuple(self.ptr_list)
        self.ptr_idx = list(range(len(self.tensors)))
        return tree

    def clear(self):
        self.ptrs = self.ptr_list = self.ptr_idx = self.keepalive = self.captured = None
        self.gen = -1

    def device(self) -> Optional[torch.device]:
        """The module's device (its first tensor's), or None for a module without tensors."""
        m = self.module
        t = next(iter(m.parameters()), None)
        if t is None:
            t = next(iter(m.buffers()), None)
        return None if t is None else t.device
