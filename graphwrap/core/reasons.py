"""Why a call runs eagerly: a small record of the reason, in words for the log and ``stats()``,
and its kind, which is what the code acts on.

Every path that declines a graph (the per-call checks, a signature graphwrap cannot key on, a
limit, a failed capture) returns an :class:`Eager` in place of the ``Facts``, ``Key`` or plan
it would have made; the caller tells the two apart by type and runs the module with
``Engine.eager``, which counts the reason and logs it once.
"""

import enum


class Kind(enum.Enum):
    """What kind of reason: what the caller does about it."""

    GRAD = "grad"  # runs eagerly with grad: training mode, an input that requires grad
    NO_GRAPHS = "no graphs here"  # CUDA absent, or the module not on a CUDA device (joined on a CPU too)
    INPUT = "input"  # the call's inputs: not keyed, not batched, not joined
    MODULE = "module"  # the module: a global hook, buffers its forward writes
    LIMIT = "limit"  # one of graphwrap's limits: max_keys, the longest sequence bucket, counting batch sizes
    CAPTURE = "capture"  # no graph for it: a capture failed, a bucket left out, graphs dropped mid-call


class Eager:
    """A call runs eagerly for ``reason`` (words), of ``kind``."""

    __slots__ = ("reason", "kind")

    def __init__(self, reason: str, kind: Kind):
        self.reason, self.kind = reason, kind

    def __str__(self) -> str:
        return self.reason

    def __repr__(self) -> str:
        return f"Eager({self.reason!r}, {self.kind.name})"

    def __eq__(self, other) -> bool:
        return type(other) is Eager and other.reason == self.reason and other.kind is self.kind

    def __hash__(self) -> int:
        return hash((self.reason, self.kind))


def input_reason(reason: str) -> Eager:
    return Eager(reason, Kind.INPUT)


def capture_reason(reason: str) -> Eager:
    return Eager(reason, Kind.CAPTURE)


TRAINING = Eager("the module is in training mode", Kind.GRAD)
NEEDS_GRAD = Eager("an input requires grad and grad mode is on", Kind.GRAD)
NO_CUDA = Eager("CUDA is not available", Kind.NO_GRAPHS)
NOT_ON_CUDA = Eager("the module is not on a CUDA device", Kind.NO_GRAPHS)
GLOBAL_HOOKS = Eager("a global forward hook is registered (nn.modules.module.register_module_forward_hook): calls "
                     "run eagerly while it is, so it runs for every submodule", Kind.MODULE)
WRITES_LARGE = Eager("the forward writes module buffers: a batch above the largest bucket runs eagerly, in one call",
                     Kind.MODULE)
DROPPED = Eager("the graphs were dropped (reset) during the call", Kind.CAPTURE)
NOT_CAPTURED = Eager("no bucket of these inputs could be captured", Kind.CAPTURE)
