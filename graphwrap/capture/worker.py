"""The engine's background worker: one thread, one job at a time, started on first use.

Jobs are background captures, compiles and tunings, and new owned-output slots: work that must
not run on a caller's path. The worker holds its engine weakly (a deleted module's graphs are
not kept alive by it), its thread waits on a queue with nothing to do (no polling), and the
jobs not started yet are cancelled when the engine goes or is reset, or when the interpreter
exits (a job that runs then finishes, and jobs that loop over buckets stop at the next one:
a script that ends never waits for the captures it no longer needs).
"""

import concurrent.futures
import concurrent.futures.thread  # its exit hook first: ours, registered after, runs before it
import logging
import threading
import time
import weakref
from typing import Callable, Optional

from ..process import EXITING, WORKERS

logger = logging.getLogger("graphwrap")


def stopping() -> bool:
    """Whether the interpreter is exiting: a job that loops stops at its next step."""
    return EXITING.is_set()


def _at_exit():
    """Before the executors' threads are joined at exit: cancel every job not started yet."""
    EXITING.set()
    for w in list(WORKERS):
        w.cancel()


# Hooks of threading run in reverse order of registration, before non-daemon threads are joined.
getattr(threading, "_register_atexit", lambda fn: None)(_at_exit)


def _run(ref, job, args):
    engine = ref()
    if engine is None or EXITING.is_set():
        return None
    try:
        return job(engine, *args)
    finally:
        del engine


class Worker:
    """``submit(job, *args)`` runs ``job(engine, *args)`` on the worker's thread."""

    def __init__(self, engine):
        self._ref = weakref.ref(engine)
        self._lock = threading.Lock()
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._futures = set()
        self._finalizer = None
        WORKERS.add(self)

    def submit(self, job: Callable, *args) -> Optional[concurrent.futures.Future]:
        """The job's future; None once the engine is gone (nothing to run it for)."""
        with self._lock:
            if self._finalizer is not None and not self._finalizer.alive:
                return None
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphwrap")
                engine = self._ref()
                if engine is not None:
                    self._finalizer = weakref.finalize(engine, _shut, self._executor)
            fut = self._executor.submit(_run, self._ref, job, args)
            self._futures.add(fut)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut):
        with self._lock:
            self._futures.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            e = fut.exception()
            logger.warning("a background job failed: %s: %s", type(e).__name__, e)

    def busy(self) -> bool:
        with self._lock:
            return bool(self._futures)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until no job is queued or running (jobs that queue others included); whether
        that happened within ``timeout`` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._futures)
            if not pending:
                return True
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            concurrent.futures.wait(pending, timeout=left)

    def cancel(self):
        """Cancel the jobs not started yet (a running one finishes)."""
        with self._lock:
            futures = list(self._futures)
        for f in futures:  # a cancelled future's callbacks run here, and take the lock
            f.cancel()


def _shut(executor):
    executor.shutdown(wait=False, cancel_futures=True)
