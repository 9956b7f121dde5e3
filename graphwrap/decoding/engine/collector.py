"""How long Python's garbage collector paused this process, by generation (``gc.callbacks``).

A collection holds the interpreter's lock: every thread waits for it, the decode thread too, so
a full collection of a process that imported torch and transformers (hundreds of thousands of
objects) is a gap of that long in every stream. ``graphwrap serve`` freezes what start-up made
(``gc.freeze()``), so that a full collection walks only what serving makes; a process that
serves through ``gm.generate`` may do the same once set up. One clock a process, started when
its first shared batch is made; ``stats()["decode"]["collector_pauses"]`` reads it. Plain
Python: the server's side imports it without torch.
"""

import gc
import threading
import time
from typing import Dict, Optional

_LOCK = threading.Lock()
_CLOCK: Optional["GcClock"] = None


class GcClock:
    """Each generation's collections, their total and their longest pause, since it was made or
    :meth:`reset`."""

    def __init__(self):
        self.began = 0.0
        self.reset()
        gc.callbacks.append(self)

    def reset(self):
        self.count = [0, 0, 0]
        self.total = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]

    def __call__(self, phase: str, info: Dict[str, int]):
        if phase == "start":
            self.began = time.perf_counter()
            return
        g, took = info["generation"], time.perf_counter() - self.began
        self.count[g] += 1
        self.total[g] += took
        self.longest[g] = max(self.longest[g], took)

    def report(self) -> Dict[str, dict]:
        return {f"gen{g}": {"collections": self.count[g], "total_ms": round(1e3 * self.total[g], 2),
                            "max_ms": round(1e3 * self.longest[g], 2)} for g in range(3)}


def clock() -> GcClock:
    """This process's clock (made on the first call)."""
    global _CLOCK
    with _LOCK:
        if _CLOCK is None:
            _CLOCK = GcClock()
        return _CLOCK
