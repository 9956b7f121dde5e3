"""Tensors a forward makes from Python numbers, made on the GPU inside a capture.

A forward that writes ``torch.tensor(0.0, device=x.device)`` or indexes with a list
(``qkv[..., [-2], :]``) copies a few numbers from the host each call. Eager does that through a
plain host buffer, which a capture refuses ("Cannot copy between CPU and CUDA tensors during
CUDA graph capture"); transformers' eager attention masks (GPT-J) and Falcon's attention do it
every step. The numbers come from the forward's own Python, so a graph holds them fixed as it
holds every other Python number of the forward (a shape, a scale, a ``torch.full`` value): a
replay must make the same tensor, not re-read the host.

:class:`HostConstants`, active only while the stream captures, makes such a tensor on the
device instead: one value filled by a kernel, several copied from a pinned buffer that the
graph keeps (its replays copy from it again, and nothing writes it). Only plain Python numbers
are taken so: a CPU tensor (an input, a buffer, anything computed) is left to fail as before,
and the call then runs eagerly.

It also serves ``torch.arange(past, past + n)`` where ``past`` is a number a forward holds on the
device (a static cache's position) and ``n`` a Python int: eager reads both bounds back to the
host, which a capture refuses; the same values are ``past + torch.arange(n)``, which a graph
records and each replay computes from the position it holds then (BART-style learned positions
in MVP, LED, TrOCR, RoFormer). Only a bound that the forward made as ``past + n`` is taken so.
"""

import weakref
from typing import Any, Callable, Dict, List

import torch
from torch.overrides import TorchFunctionMode

Tensor = torch.Tensor
MAX_NUMBERS = 4096  # a larger literal is not a constant of the kind this serves
_MAKERS = (torch.tensor, torch.as_tensor)
_GET, _SET = torch._C.TensorBase.__getitem__, torch._C.TensorBase.__setitem__
_ADDS = (torch.add, Tensor.add, Tensor.__add__, Tensor.__radd__)


def plain_numbers(data, limit: int = MAX_NUMBERS) -> bool:
    """Whether ``data`` is a Python number, or lists and tuples of them (bools included),
    ``limit`` numbers at most."""
    left = [limit]

    def ok(x) -> bool:
        if isinstance(x, (bool, int, float)):
            left[0] -= 1
            return left[0] >= 0
        return isinstance(x, (list, tuple)) and all(ok(v) for v in x)
    return ok(data)


def int_list(x) -> bool:
    """An index list of Python ints (not bools, which index as a mask)."""
    return (isinstance(x, list) and 0 < len(x) <= MAX_NUMBERS
            and all(isinstance(v, int) and not isinstance(v, bool) for v in x))


class HostConstants(TorchFunctionMode):
    """While active (on this thread), ``torch.tensor``/``torch.as_tensor`` of plain Python
    numbers on a CUDA device, and list indices into a CUDA tensor, are made on the device
    without a copy from pageable host memory. ``kept`` holds the pinned buffers the captured
    copies read: whoever holds the graph holds them."""

    def __init__(self, kept: List[Tensor], device_type: str = "cuda", pin: bool = True):
        super().__init__()
        self.kept = kept
        self.sums: Dict[int, tuple] = {}  # past + n: {id(that sum): (a weak reference to it, past, n)} (never ==: a tensor's is elementwise)
        self.device_type, self.pin = device_type, pin  # another device and no pinning: the CPU tests

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MAKERS and args and plain_numbers(args[0]):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == self.device_type:
                rest = {k: v for k, v in kwargs.items() if k != "device"}
                return self.constant(func(args[0], **rest), torch.device(device))
        elif (func is _GET or func is _SET) and len(args) >= 2 and isinstance(args[0], Tensor) \
                and args[0].device.type == self.device_type:
            index = self.indices(args[1], args[0].device)
            if index is not args[1]:
                args = (args[0], index) + tuple(args[2:])
        elif func is torch.arange and len(args) == 2 and id(args[1]) in self.sums:
            ref, past, n = self.sums[id(args[1])]
            if ref() is args[1] and args[0] is past:
                return self.arange(past, n, **kwargs)
        elif func in _ADDS and len(args) == 2 and not kwargs:
            out = func(*args)
            self.note_sum(out, *args)
            return out
        return func(*args, **kwargs)

    def note_sum(self, out, a, b):
        """Keep ``out`` as ``past + n`` where one operand is a 0-d integer tensor on the device and
        the other a Python int."""
        past, n = (a, b) if isinstance(a, Tensor) else (b, a)
        if (isinstance(past, Tensor) and isinstance(n, int) and not isinstance(n, bool) and past.dim() == 0
                and past.device.type == self.device_type and not past.is_floating_point()
                and past.dtype != torch.bool and isinstance(out, Tensor)):
            self.sums[id(out)] = (weakref.ref(out), past, n)

    def arange(self, past: Tensor, n: int, dtype=None, device=None, **rest):
        """``torch.arange(past, past + n)``'s values, made on the device without reading ``past``."""
        if rest.get("requires_grad") or rest.get("out") is not None or rest.get("layout") not in (None, torch.strided):
            raise RuntimeError("arange over a position on the device: only dtype= and device= are served")
        device = torch.device(device) if device is not None else past.device
        steps = torch.arange(max(n, 0), device=device, dtype=torch.long)
        return (past.to(device=device, dtype=torch.long) + steps).to(dtype or past.dtype)

    def indices(self, index, device):
        """``index`` with each list of ints made a device tensor (the same selection)."""
        if int_list(index):
            return self.constant(torch.tensor(index, dtype=torch.long), device)
        if isinstance(index, tuple) and any(int_list(i) for i in index):
            return tuple(self.constant(torch.tensor(i, dtype=torch.long), device) if int_list(i) else i
                         for i in index)
        return index

    def constant(self, cpu: Tensor, device: torch.device) -> Tensor:
        """``cpu``'s values in a new tensor on ``device``, made by work a graph can record."""
        flat = cpu.reshape(-1)
        if flat.numel() and bool((flat == flat[0]).all()):
            out = torch.full(cpu.shape, flat[0].item(), dtype=cpu.dtype, device=device)
        else:
            pinned = cpu.pin_memory() if self.pin else cpu.clone()
            self.kept.append(pinned)
            out = torch.empty(cpu.shape, dtype=cpu.dtype, device=device)
            out.copy_(pinned, non_blocking=True)
        return out.requires_grad_(cpu.requires_grad)


def with_constants(run):
    """``run`` whose Python-number tensors are made on the device while a capture records it
    (:class:`HostConstants`); outside a capture it runs as it is. The returned callable holds
    the pinned buffers its captures read (``.kept``)."""
    return _CapturedRun(run)


class _CapturedRun:
    def __init__(self, run: Callable[[], Any]):
        self.run = run
        self.kept: List[Tensor] = []

    def __call__(self):
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return self.run()
        with HostConstants(self.kept):
            return self.run()
