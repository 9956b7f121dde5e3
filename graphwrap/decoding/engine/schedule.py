"""The turn's first part, scheduling (:mod:`.loop`): under the batch's lock, the calls cancelled or
failed since the last turn are ended, and queued sequences are admitted into free rows with the
blocks they need (:meth:`~.scheduler.Scheduler.admit`; a CPU's pool grown first where they lack
blocks). It writes only the scheduler's state (queue, rows, blocks, each sequence's place); what
the turn then runs is :mod:`.prefill`'s, :mod:`.pieces`' and :mod:`.steps`' work.
"""

import time
from dataclasses import dataclass, field
from typing import List, Optional

from . import growth
from .scheduler import Seq

# Prompt tokens a turn admits while rows decode (None: every queued prompt a row is free for).
# A turn's prefill is time every decoding row waits for its next token
# (``benchmarks/scheduler.py --prefill-beside`` measures it; benchmarks/results/h200-2026-11-27-step-norm/).
PREFILL_BESIDE: Optional[int] = None


@dataclass
class Turn:
    """What a turn serves: the sequences admitted in it (their prompts go first), or nothing to
    run (``idle``: the thread waited for work and turns again)."""

    admitted: List[Seq] = field(default_factory=list)
    idle: bool = False


def schedule(server) -> Optional[Turn]:
    """The next turn's work; None once the thread ends (closed with nothing left, or stopped: every
    call it held ended with the reason)."""
    with server.cond:
        stopping = server.stopping
        if stopping is not None:
            calls = {s.call for s in server.all_seqs()}
            server.sched.queue.clear()
            server.cond.notify_all()
    if stopping is not None:
        for call in calls:
            server.end_call(call, stopping)
        with server.cond:  # (their records let go of their rows: plain Python, no device work at the process's exit)
            server.sched.retire()
        return None
    with server.cond:
        take_cancelled(server)
        got = admitted(server)
        if got:
            server.cond.notify_all()  # room in the queue
            now = time.perf_counter()
            server.waits.extend(now - s.submitted for s in got if not s.preempted)
            return Turn(got)
        if server.inflight.queued or any(s is not None for s in server.sched.holders):
            return Turn()  # (a sequence just cancelled or ended still holds its row: the turn retires it)
        if server.closed and not server.sched.queue:
            return None
        server.flush()  # (what a cancel just ended, before waiting)
        server.cond.wait()
        return Turn(idle=True)


def take_cancelled(server):
    """Calls cancelled or failed from other threads since the last turn, ended (queued sequences
    of theirs leave the queue; running ones give their rows back at the turn's retire)."""
    for call in server.cancelled:
        if not call.ended:
            server.sched.drop_queued(lambda s: s.call is call)
            server.end_call(call, call.error)
    server.cancelled.clear()


def admitted(server) -> List[Seq]:
    """Queued sequences given a row this turn, the pool grown first where they lack blocks and it
    can; beside decoding rows, prompts of :data:`PREFILL_BESIDE` tokens at most (where set: each
    token prefilled is time those rows wait)."""
    if server.prefixes_stale:  # (the weights' values changed in place: weights.note_values)
        server.prefixes_stale = False
        server.sched.drop_prefixes()
    budget = PREFILL_BESIDE if PREFILL_BESIDE and server.sched.live() else None
    got = server.sched.admit(tokens=budget)
    if server.sched.short and growth.grow_pool(server, server.sched.short):
        got += server.sched.admit(tokens=budget)
    return got
