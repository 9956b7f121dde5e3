"""Where the module's parameters and buffers were when its graphs were captured.

A graph reads the weights from the addresses it was captured with. Replacing a parameter,
moving the module (``.to``, ``.half``) or adding a tensor changes them; the engine asks
:meth:`Weights.current` on every call and drops the graphs when it says no.
"""

from typing import List, Optional

import torch

from . import _compat

Tensor = torch.Tensor
_data_ptr = Tensor.data_ptr
# Bumped by global hooks whenever any module gets a new parameter, buffer or submodule; a
# Weights re-reads its module's tensors when it sees a new value.
GENERATION = [0]
_HOOKS_INSTALLED = []
# Whether each tensor still has the data pointer recorded for it: one C++ loop (CUDA builds).
_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def _bump(*_args):
    GENERATION[0] += 1


def install_hooks():
    if not _HOOKS_INSTALLED:
        for register in _compat.registration_hooks():
            _HOOKS_INSTALLED.append(register(_bump))
        _HOOKS_INSTALLED.append(True)


class Weights:
    """The module's tensors and, once graphs exist, the addresses they were captured with."""

    __slots__ = ("module", "gen", "tensors", "ptrs", "ptr_list", "ptr_idx", "keepalive")

    def __init__(self, module):
        install_hooks()
        self.module = module
        self.gen = -1
        self.tensors: List[Tensor] = []
        self.ptrs: Optional[tuple] = None
        self.ptr_list = self.ptr_idx = self.keepalive = None

    def unmoved(self) -> bool:
        """Whether every parameter and buffer is where it was when the graphs were captured."""
        if _ptrs_equal is not None:
            return _ptrs_equal(self.tensors, self.ptr_list, self.ptr_idx)
        return tuple(map(_data_ptr, self.tensors)) == self.ptrs

    def current(self) -> bool:
        """The per-call check: no tensor added anywhere since the last look, none moved."""
        return GENERATION[0] == self.gen and self.unmoved()

    def refresh(self) -> bool:
        """Re-read the module's tensors; whether they moved since the graphs were captured."""
        self.tensors = list(self.module.parameters()) + list(self.module.buffers())
        self.gen = GENERATION[0]
        return self.ptrs is not None and (len(self.tensors) != len(self.ptrs) or not self.unmoved())

    def moved(self) -> bool:
        """Whether the graphs must go: checked on the general call path."""
        if GENERATION[0] != self.gen and self.refresh():
            return True
        return self.ptrs is not None and not self.unmoved()

    def record(self):
        """The addresses the graphs are about to be captured with; the tensors kept alive, so no
        graph ever replays on freed memory."""
        self.refresh()
        self.keepalive = list(self.tensors)
        self.ptr_list = [t.data_ptr() for t in self.tensors]
        self.ptrs = tuple(self.ptr_list)
        self.ptr_idx = list(range(len(self.tensors)))

    def clear(self):
        self.ptrs = self.ptr_list = self.ptr_idx = self.keepalive = None
        self.gen = -1

    def device(self) -> Optional[torch.device]:
        """The module's device (its first tensor's), or None for a module without tensors."""
        m = self.module
        t = next(iter(m.parameters()), None)
        if t is None:
            t = next(iter(m.buffers()), None)
        return None if t is None else t.device
