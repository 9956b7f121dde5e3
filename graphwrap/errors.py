"""The one exception type graphwrap raises."""


class GraphwrapError(RuntimeError):
    """Raised for bad arguments, bad inputs and (with ``fallback="raise"``) failed captures.

    Messages say what went wrong, show the values involved and say how to fix it.
    Where another exception caused it, that exception is chained as ``__cause__``.
    """
