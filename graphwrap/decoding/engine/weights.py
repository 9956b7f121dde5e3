"""The model's weights as a decode batch was made with them (plain Python over tensors' addresses)."""

import logging

from ...core.watch import follow
from ...process import GENERATION

logger = logging.getLogger("graphwrap")


class Weights:
    """The model's parameters as the batch was made with them: their addresses, dtypes and
    devices, read again only where they could have moved (cheap per call: one pass over a list
    of tensors; the list is read again when a module registers a new parameter); and the
    version counters of its parameters and buffers, which every change of their values in place
    moves (``load_state_dict``, an optimizer's step: the graphs read the new values, but keys
    and values cached for a prefix were made with the old)."""

    def __init__(self, model):
        self.model = model
        self.generation = GENERATION[0]
        follow(model.modules())
        self.params = list(model.parameters())
        self.seen = self._read()
        self.tensors = self.params + list(model.buffers())
        self.versions = self.made = self._versions()
        self.count = sum(t.numel() for t in self.tensors)  # (weights a forward reads, about: pieces.WHOLE_FROM)

    def _versions(self):
        return [t._version for t in self.tensors]

    def values_changed(self) -> bool:
        """Whether a parameter's or buffer's values changed in place since the last time asked
        (or since the batch was made)."""
        now = self._versions()
        if now == self.versions:
            return False
        self.versions = now
        return True

    def values_since_made(self) -> bool:
        """Whether a parameter's or buffer's values changed in place since the batch was made."""
        return self._versions() != self.made

    def _read(self):
        return [(p.data_ptr(), p.dtype, p.device) for p in self.params]

    def changed(self) -> bool:
        if GENERATION[0] != self.generation:
            params = list(self.model.parameters())
            if len(params) != len(self.params) or any(a is not b for a, b in zip(params, self.params)):
                return True
            follow(self.model.modules())
            self.generation = GENERATION[0]
        return self._read() != self.seen


def note_values(server):
    """Before a call is queued: where the model's values changed in place since the last, the
    batch drops its prefix cache before it admits again (its blocks hold keys and values the old
    weights made), and says so."""
    pool = server.sched.pool
    if pool is not None and pool.prefixes is not None and server.weights.values_changed():
        server.prefixes_stale = True
        logger.info("the model's weights changed in place since the last call: the prefix cache is dropped")
