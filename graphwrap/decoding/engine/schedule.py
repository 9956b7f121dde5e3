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

# Prompt tokens a turn admits while rows decode, where the batch's ``decode={"prefill_beside": N}``
# does not say (0 there: every queued prompt a row is free for). A turn's prefill is time every
# decoding row waits for its next token. On a Llama-3-8B shape (H200), 1,024 requests of 128
# tokens in and 128 out at once: with no bound a turn admitted 948 prompts and the rows decoding
# waited 2.1-2.6 s for their next token; with 8,192 the longest turn was 0.40 s, the first
# tokens' median 1.59 s against 2.25-2.60, at 0.98x the tokens/s (256 at once: 0.23 s against
# 0.56-0.61, 1.01x); ``benchmarks/scheduler.py --prefill-beside 0,8192,4096,0``,
# benchmarks/results/h200-2026-11-30-loop/. A feed that goes in pieces counts its first piece's
# share (the chunk) only.
PREFILL_BESIDE: Optional[int] = 8192


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
    can; beside decoding rows, prompts of :func:`beside_of` tokens at most (each token prefilled is
    time those rows wait)."""
    if server.prefixes_stale:  # (the weights' values changed in place: weights.note_values)
        server.prefixes_stale = False
        server.sched.drop_prefixes()
    bound = beside_of(server)
    budget = bound if bound and server.sched.live() else None
    got = server.sched.admit(tokens=budget)
    if server.sched.short and growth.grow_pool(server, server.sched.short):
        got += server.sched.admit(tokens=budget)
    return got


def beside_of(server) -> int:
    """Prompt tokens a turn admits while rows decode, the batch's or :data:`PREFILL_BESIDE` (0: no bound)."""
    return (PREFILL_BESIDE if server.beside is None else server.beside) or 0
