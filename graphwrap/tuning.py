"""Per-size kernels for the buckets that serve calls, compiled and swapped in the background.

With ``compile=True`` one compile, dynamic in the batch dimension, serves every bucket: the
start is fast, but shape-generic kernels can be slower than kernels compiled for one shape
(Inductor leaves convolutions in their default layout when the batch is dynamic, and some
passes run only on static shapes). The tuner closes that gap where it matters: a thread of
the engine takes the bucket that has served the most rows among those with at least
``HOT_CALLS`` calls, compiles kernels for its shape, captures them, times the new graph
against a graph of the shared kernels (replays alone, interleaved, medians), and keeps the
new one only if it is at least ``1 - GAIN`` faster. Calls are served all the while, by the
shared kernels until the swap. Each bucket is tuned once.

The engine supplies the work (:meth:`Engine.tune_next`); this module holds the choice of the
next bucket, the decision, the timing and the thread.
"""

import threading
import time
import weakref
from typing import Callable, Iterable, Optional, Tuple

from .capture import time_pair, timed_calls

HOT_CALLS = 16  # calls a bucket serves before its own kernels are worth a compile
GAIN = 0.97  # the per-size graph is kept if it replays in at most this share of the time
POLL_S = 0.2  # how often the thread looks for a hot bucket while some are untuned


def hottest(candidates: Iterable[Tuple[int, int, object]], hot_calls: Optional[int] = None):
    """The item of ``(rows, calls, item)`` with the most rows among those with at least
    ``hot_calls`` (default ``HOT_CALLS``) calls; None if there is none."""
    hot_calls = HOT_CALLS if hot_calls is None else hot_calls
    best = None
    for rows, calls, item in candidates:
        if calls >= hot_calls and (best is None or rows > best[0]):
            best = (rows, item)
    return None if best is None else best[1]


def keep_new(old_s: float, new_s: float, gain: Optional[float] = None) -> bool:
    """Whether a graph that replays in ``new_s`` replaces one that replays in ``old_s``."""
    return new_s <= (GAIN if gain is None else gain) * old_s


def time_replays(old: Callable[[], None], new: Callable[[], None], timed=None, rounds: int = 7,
                 round_s: float = 2e-3) -> Tuple[float, float]:
    """Seconds per replay of ``old`` and ``new``, in turns round by round; medians. ``timed(fn,
    k)`` times ``fn(k)`` (k calls); by default with the device synchronized around them."""
    def loop(fn):
        def run(k):
            for _ in range(k):
                fn()
        return run

    return time_pair(loop(old), loop(new), rounds, round_s, timed=timed or timed_calls)


class Tuner:
    """The engine's tuning thread: started when a bucket is captured with shared kernels, it
    tunes hot buckets until none is left untuned, then ends. It holds the engine weakly, so
    a deleted module's graphs are not kept alive by it."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)
        self._thread: Optional[threading.Thread] = None
        self._cond = threading.Condition()
        self.busy = False  # a bucket is being tuned
        self.error: Optional[str] = None

    def start(self):
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._run, name="graphwrap-tune", daemon=True)
            self._thread.start()

    def _run(self):
        while True:
            engine = self._engine()
            if engine is None:
                return
            with self._cond:
                self.busy = True
            try:
                state = engine.tune_next()  # "tuned", "waiting" (untuned buckets, none hot) or "done"
            except Exception as e:  # noqa: BLE001 - reported in stats(); calls go on with the shared kernels
                self.error = f"{type(e).__name__}: {e}"
                state = "done"
            finally:
                with self._cond:
                    self.busy = False
                    self._cond.notify_all()
            del engine
            if state == "done":
                return
            if state == "waiting":
                time.sleep(POLL_S)

    def wait(self, pending: Callable[[], bool], timeout: Optional[float] = None) -> bool:
        """Wait until no tuning runs and ``pending()`` (hot buckets left untuned) is False;
        whether that happened within ``timeout``."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                busy = self.busy
                alive = self._thread is not None and self._thread.is_alive()
            # pending() takes the engine's lock: never called holding _cond (the engine starts
            # the thread holding its lock).
            if not busy and (not alive or not pending()):
                return True
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            with self._cond:
                self._cond.wait(POLL_S if left is None else min(POLL_S, left))
