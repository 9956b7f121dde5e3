"""Each call's tokens and result, handed to it off the decode thread.

The decode thread never runs a caller's code: a streamer's ``put`` and ``end``, a future's
result and the callbacks a caller hung on it all run on a delivery worker. Each call has a
:class:`Mailbox`, a queue of deliveries drained in order by one worker at a time; a slow or
failing streamer holds up only its own call (a worker stuck in it is left to it, and another
takes the other mailboxes). Workers are daemon threads made as needed (at most ``MAX_WORKERS``
at once, then mailboxes wait their turn) and kept for the next call.

Lock rules: a mailbox's lock guards its queue and its ``scheduled`` flag only; the outbox's lock
guards the ready mailboxes and the workers' counts only; neither is held while a delivery
runs, and neither is taken under the decode server's lock by code that could wait on a caller.
"""

import collections
import logging
import threading
import time
from typing import Callable, Deque, Dict, List, Tuple

logger = logging.getLogger("graphwrap")
MAX_WORKERS = 256
STALLED = 0.005  # seconds in one delivery after which a worker counts as stuck (others take the rest)


class Mailbox:
    """One call's deliveries, in order."""

    __slots__ = ("lock", "items", "scheduled", "on_error")

    def __init__(self, on_error: Callable[[BaseException], None]):
        self.lock = threading.Lock()
        self.items: Deque[Callable[[], None]] = collections.deque()
        self.scheduled = False
        self.on_error = on_error  # called on the worker with what a delivery raised


class Outbox:
    """The delivery workers of the process.

    Few workers wake: a mailbox that becomes ready is left to the workers already running, and
    the worker standing by takes it only where none runs or every running one has been inside one
    delivery for longer than ``STALLED`` seconds (a slow streamer). One worker always stands by
    (until ``max_workers``): a worker that leaves the stand-by to take a mailbox starts another in
    its place, or, where others stand by and mailboxes still wait, wakes one of them to watch
    those (a running worker that takes the next mailbox wakes nobody), so that mailboxes queued
    behind stuck workers are taken whether or not any post comes after them. The decode thread's
    posts then cost an append, not a thread's wake-up per token."""

    def __init__(self, max_workers: int = MAX_WORKERS):
        self.cond = threading.Condition(threading.Lock())  # guards everything below
        self.ready: Deque[Mailbox] = collections.deque()
        self.idle = 0  # workers standing by (waiting for a mailbox), or started and about to
        self.workers = 0
        self.busy: Dict[int, float] = {}  # worker id -> when its current delivery began
        self.max_workers = max_workers

    def post(self, box: Mailbox, delivery: Callable[[], None]):
        """Queue ``delivery`` behind the mailbox's others (returns at once)."""
        self.post_many([(box, delivery)])

    def post_many(self, deliveries: List[Tuple[Mailbox, Callable[[], None]]]):
        """Queue each ``(mailbox, delivery)`` in order (a decode step's tokens at once: at most
        one worker woken for them all)."""
        ready = []
        for box, delivery in deliveries:
            with box.lock:
                box.items.append(delivery)
                if box.scheduled:
                    continue
                box.scheduled = True
            ready.append(box)
        if not ready:
            return
        with self.cond:
            was_empty = not self.ready
            self.ready.extend(ready)
            if self.idle:
                if was_empty or self._all_stalled():
                    self.cond.notify()  # the worker standing by: to take them, or to watch the running ones
                return
            spawn = self._stand_by()
        if spawn:
            self._spawn()

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for no mailbox to wait and no worker to be delivering
        (each worker then holds no call: what it delivered is freed); whether that came. At exit:
        a daemon worker freeing a call's tensors while the interpreter finalizes aborts the
        process (its thread is ended inside torch's deallocation)."""
        end = time.monotonic() + timeout
        while True:
            with self.cond:
                if not self.ready and not self.busy:
                    return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.001)  # (polled: a wait on the condition could take a wake-up meant for a worker)

    def _stand_by(self) -> bool:
        """Whether a worker must be started to stand by (none does; the caller holds the lock)."""
        if self.idle or self.workers >= self.max_workers:
            return False
        self.workers += 1
        self.idle += 1  # (counted standing by from now: no second one is started meanwhile)
        return True

    def _spawn(self):
        threading.Thread(target=self._work, name="graphwrap-deliver", daemon=True).start()

    def _all_stalled(self) -> bool:
        """No worker is running, or every running one is stuck in one delivery (the caller holds
        the lock)."""
        now = time.monotonic()
        return all(now - t > STALLED for t in self.busy.values())

    def _work(self):
        me = threading.get_ident()
        _HERE.worker = True
        standing = True  # (a worker starts standing by: counted in idle by its starter)
        while True:
            with self.cond:
                self.busy.pop(me, None)
                if not standing and not self.ready:
                    standing = True
                    self.idle += 1
                watched = standing  # (the waiting mailboxes, for the workers standing by)
                if standing:
                    # Standing by: it takes a mailbox only where no running worker will soon (none
                    # runs, or each is stuck); it looks again every STALLED seconds while mailboxes
                    # wait, and is woken when the first one comes.
                    while not (self.ready and self._all_stalled()):
                        self.cond.wait(STALLED if self.ready else None)
                    self.idle -= 1
                    standing = False
                box = self.ready.popleft()
                self.busy[me] = time.monotonic()
                spawn = self._stand_by()  # another in its place
                if watched and self.ready and self.idle and not spawn:
                    # It watched for the others standing by (a post wakes one of them) and may now
                    # be stuck in the mailbox it took: another watches those still waiting.
                    self.cond.notify()
            if spawn:
                self._spawn()
            self._drain(box, self.busy, me)
            del box  # (not held while waiting: it holds its call, and the call its batch)

    @staticmethod
    def _drain(box: Mailbox, busy: Dict[int, float], me: int):
        while True:
            with box.lock:
                if not box.items:
                    box.scheduled = False
                    return
                delivery = box.items.popleft()
            busy[me] = time.monotonic()
            try:
                delivery()
            except BaseException as e:  # noqa: BLE001 - a caller's code failed: its own call ends with it
                try:
                    box.on_error(e)
                except BaseException:  # noqa: BLE001 - the worker must live on for the other calls
                    logger.exception("a delivery's failure could not be reported to its call")


OUTBOX = Outbox()
_HERE = threading.local()


def on_worker() -> bool:
    """Whether this thread is a delivery worker (a caller's callback or streamer running here
    must not wait for deliveries: its own is one of them)."""
    return getattr(_HERE, "worker", False)
