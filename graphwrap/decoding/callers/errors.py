"""The errors a caller gets where the shared decode batch takes no call (no torch here: the
server's process knows them before it imports torch)."""

from typing import Any

from ...errors import GraphwrapError


class Closed(GraphwrapError):
    """The decode batch was closed before the call could be queued (the caller may take a new one)."""


class QueueFull(GraphwrapError):
    """The decode queue holds ``max_queue`` sequences (raised where the caller would not wait)."""

    server: Any = None  # the batch and the call prepared for it, where the caller queues it later
    call: Any = None
