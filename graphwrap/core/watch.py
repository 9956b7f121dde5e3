"""What a graph depends on besides its inputs, and the per-call check that it is unchanged.

A graph replays what the module did when it was captured: the tensors it read (at their
addresses), the submodules it ran, their training flags, the forward hooks that ran with them
and the default dtype. :class:`Watch` records these when graphs are first captured and tells
the engine when one of them changed, so the graphs are dropped and captured again before the
next replay.

The per-call check reads counters, not the module tree: one that PyTorch's global registration
hooks and ``nn.Module.train`` bump (a parameter, buffer or submodule assigned anywhere, a
training flag set through ``train()``/``eval()``), the id of the last hook handle PyTorch made
(every hook registration makes one), the default dtype, the lengths of the hook tables that
held hooks at capture (a removal), and the tensors' addresses. Only when a counter moved is the
tree read again and compared with the one the graphs were captured with.

Not seen: a training flag assigned directly on a submodule (``m.drop.training = True``; the top
module's flag is read on every call), hook tables edited by hand, and plain Python attributes
the forward reads. Those are frozen into the graphs: call ``gm.reset()`` after changing them.
"""

import functools
from typing import List, Optional

import torch
from torch import nn
from torch.nn.modules import module as _nn_module
from torch.utils.hooks import RemovableHandle

from .. import _compat
from ..process import GENERATION, WATCH_INSTALLED
from .reasons import Eager, Kind

Tensor = torch.Tensor
_data_ptr = Tensor.data_ptr
_default_dtype = torch.get_default_dtype
# Bumped whenever any module gets a new parameter, buffer or submodule, and by every train():
# a Watch re-reads its module when it sees a new value.
# Whether each tensor still has the data pointer recorded for it: one C++ loop (CUDA builds).
_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
# The hook tables a forward runs: per module, and for every module at once. A global forward
# hook runs for every module a forward calls, which no replay can do: while one is registered,
# calls run eagerly (GraphedModule.forward), and the graphs stay for when it is gone.
HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks")
GLOBAL_TABLES = tuple(getattr(_nn_module, n) for n in ("_global_forward_pre_hooks", "_global_forward_hooks")
                      if hasattr(_nn_module, n))


def _bump(*_args):
    GENERATION[0] += 1


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
        counted_train._graphwrap_counts = True
        nn.Module.train = counted_train
    WATCH_INSTALLED.append(True)


class Tree:
    """The module tree as a forward sees it: its submodules, their training flags and forward
    hooks, and the default dtype."""

    __slots__ = ("names", "modules", "flags", "hooks", "dtype")

    def __init__(self, module: nn.Module):
        named = list(module.named_modules())
        self.names = tuple(n for n, _ in named)
        self.modules = tuple(m for _, m in named)
        self.flags = tuple(m.training for m in self.modules)
        self.hooks = tuple(tuple(tuple(getattr(m, t, {})) for t in HOOK_TABLES) for m in self.modules)
        self.dtype = _default_dtype()

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

    def _refresh(self) -> Tree:
        self.gen, self.hid, self.dtype = GENERATION[0], RemovableHandle.next_id, _default_dtype()
        self.tensors = list(self.module.parameters()) + list(self.module.buffers())
        tree = Tree(self.module)
        self.sized = tree.sized()
        why = tree.training()
        self.eager = None if why is None else Eager(why, Kind.GRAD)
        return tree

    def record(self) -> Tree:
        """What the graphs are about to be captured with; the tensors kept alive, so no graph
        ever replays on freed memory."""
        tree = self._refresh()
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
