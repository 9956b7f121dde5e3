"""The module's own state across a capture: one call changes it exactly as one eager call does.

A capture runs the forward several times besides the call it serves: a reference run, warm-ups,
checks at other shapes, verification replays, the race against eager. A forward that writes its
module's buffers (a step counter, running statistics, a cache kept in buffers) would see each of
those runs. :class:`Saved` copies the buffers before a capture and puts back, before each run
and at the end, every buffer whose version counter moved; what the forward wrote is then known,
and the engine serves such a module without padding, chunking or joining requests (each of
which would write state the eager call does not).
"""

from typing import List, Set, Tuple

import torch

Tensor = torch.Tensor


class Saved:
    """The module's buffers as they were when a capture began."""

    __slots__ = ("items", "params", "written")

    def __init__(self, module: torch.nn.Module):
        with torch.inference_mode(False), torch.no_grad():
            # Inference tensors keep no version counter and cannot be written outside that mode.
            self.items: List[Tuple[str, Tensor, int, Tensor]] = [
                (name, t, t._version, t.clone()) for name, t in module.named_buffers() if not t.is_inference()]
        self.params = [(name, p, p._version) for name, p in module.named_parameters() if not p.is_inference()]
        self.written: Set[str] = set()

    def restore(self):
        """Put back every buffer written since the capture began (on the current stream). An eager
        run bumps the version counter of what it writes; a graph replay does not, so a buffer
        once seen written is put back every time."""
        for i, (name, t, v, saved) in enumerate(self.items):
            if t._version != v or name in self.written:
                with torch.inference_mode(False), torch.no_grad():
                    t.copy_(saved)
                self.written.add(name)
                self.items[i] = (name, t, t._version, saved)

    def check_params(self):
        """Raise CaptureFailed if the forward wrote into its parameters (they are not copied, so
        not put back: such a module runs eagerly; the run that found it stays)."""
        from .checks import CaptureFailed

        written = [name for name, p, v in self.params if p._version != v]
        if written:
            raise CaptureFailed(f"the forward writes into its parameters {', '.join(written[:3])}; such a module "
                                "runs eagerly")
