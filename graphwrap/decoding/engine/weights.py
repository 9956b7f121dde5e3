"""The model's weights as a decode batch was made with them (plain Python over tensors' addresses)."""

from ...core.watch import follow
from ...process import GENERATION


class Weights:
    """The model's parameters as the batch was made with them: their addresses, dtypes and
    devices, read again only where they could have moved (cheap per call: one pass over a list
    of tensors; the list is read again when a module registers a new parameter)."""

    def __init__(self, model):
        self.model = model
        self.generation = GENERATION[0]
        follow(model.modules())
        self.params = list(model.parameters())
        self.seen = self._read()

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
