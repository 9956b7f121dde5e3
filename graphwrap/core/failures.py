"""A capture that failed, and what its failure rules out: raised by the capture side and read by
the engine's state and records, so it sits below both."""

import enum
from typing import Optional, Set


class Scope(enum.Enum):
    """What a failed capture rules out."""

    KEY = "key"  # every bucket of the signature would fail the same way (a host sync, rows mixed)
    BUCKET = "bucket"  # only this size (out of memory)
    BUDGET = "budget"  # the bucket would take the graph pool over its budget
    COMPILE = "compile"  # the compiled forward (the plain forward may still capture)
    SEQ = "seq"  # padding along the sequence changes results: lengths are served exactly
    STATE = "state"  # the forward writes module buffers and the bucket pads the call


class CaptureFailed(Exception):
    """A bucket could not be captured or did not verify; ``scope`` (a :class:`Scope`) says
    what that rules out."""

    def __init__(self, reason: str, cause: Optional[BaseException] = None, scope: Scope = Scope.KEY,
                 pool_lost: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.cause = cause
        self.scope = scope
        self.pool_lost = pool_lost  # the pool cannot take further captures
        self.pool_estimate = 0  # Scope.BUDGET: the bytes the bucket was estimated to need
        self.written: Set[str] = set()  # Scope.STATE: the buffers the forward writes
