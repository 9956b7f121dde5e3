"""graphwrap's log: records of the ``graphwrap`` logger, their messages without a prefix of
their own (a user's format names the logger: ``%(name)s: %(message)s`` prints
"graphwrap: ..." once).

Where nobody has set up logging (no handler on the root logger or on the way to it), Python
would print a warning's bare message; :class:`Unconfigured` prints it as "graphwrap: ..." then,
and nothing once the user has a handler of their own.
"""

import logging
from typing import Optional

PREFIX = "graphwrap: "


class Unconfigured(logging.StreamHandler):
    """Python's last-resort output (warnings and above, to stderr), naming graphwrap, for as
    long as no other handler would take graphwrap's records."""

    def __init__(self):
        super().__init__()  # sys.stderr, looked up at each record
        self.setLevel(logging.WARNING)
        self.setFormatter(logging.Formatter(PREFIX + "%(message)s"))

    def handle(self, record):
        node: Optional[logging.Logger] = logging.getLogger("graphwrap")
        while node is not None:
            if any(h is not self for h in node.handlers):
                return False  # someone else's handler shows it
            if not node.propagate:
                break
            node = node.parent
        return super().handle(record)


def install():
    logger = logging.getLogger("graphwrap")
    if not any(isinstance(h, Unconfigured) for h in logger.handlers):
        logger.addHandler(Unconfigured())
