"""The turn's third part, processing outputs (:mod:`.loop`): the tokens of the steps queued on the
device are read on the host, each appended to its sequence's record and handed towards its call
(a sink's tokens at the turn's end, a streamer's by a delivery worker); a sequence that made its
end token or its last wanted one is done, and its call ends once its last sequence is. Then the
rows of sequences that want no further step are given back: by the scheduler (row and blocks,
:meth:`~.scheduler.Scheduler.retire`) and on the device (block table, settings).

What this part writes: each sequence's tokens, ``done`` and times, the calls' deliveries (through
:meth:`~.server.DecodeServer.end_call`) and the rows it gives back. Room-making for a growing row
(:mod:`.growth`) drains through it: a preemption needs every token in flight read first.
"""

from typing import List, Optional

import torch

from ...errors import GraphwrapError
from ..cache.rows import to_device
from ..callers.calls import Logprobs, put_token
from .sampling import Active
from .scheduler import Seq

AHEAD = 2  # steps queued on the device before the host reads the oldest


def read(server, keep: int):
    """Hand out the tokens of every step but the last ``keep`` (and of any already done)."""
    for f, tokens, now in server.inflight.read(keep, server.spent, server.flush):
        for s, at in zip(f.seqs, f.rows):
            if not s.done:
                k = s.settings.logprobs
                token(server, s, tokens[at], now, Logprobs(f.extras, at, f.most, k) if k >= 0 and f.extras else None)


def token(server, s: Seq, made: int, now: float, lp: Optional[Logprobs] = None):
    """``made``, read at ``now``, is ``s``'s next token: kept, handed towards its call, and
    ``s`` done where it ends the sequence (its call ended where it was the last)."""
    s.tokens.append(made)
    if s.first_at is None:
        s.first_at = now
        server.ttft.append(now - s.submitted)
    s.last_at = now
    call = s.call
    streamer = call.plan.streamer
    if call.sink is not None:
        server.sinks.add(call, made, now, lp)
    elif streamer is not None:
        server.outgoing.append((call.box, lambda: put_token(call, streamer, made, now, server.lag, lp)))
    if s.matcher is not None and not s.matcher.made(made):
        server.end_call(call, GraphwrapError(f"token {made} broke the call's grammar (a bug of the batch's masks)"))
        return
    if made in s.settings.eos or len(s.tokens) >= s.settings.max_new or (s.matcher is not None and s.matcher.ended):
        s.done = True
        if len(s.tokens) > 1:
            server.tpot.append((s.last_at - s.first_at) / (len(s.tokens) - 1))
        call.left -= 1
        if call.left == 0:
            server.end_call(call, None)


def retire(server):
    """The rows of sequences that want no further step, given back (row, blocks, settings)."""
    rows = server.sched.retire()
    if rows:
        release(server, rows)


def release(server, rows: List[int]):
    """Rows the scheduler gave back, released on the device: their block tables and settings."""
    index = to_device(torch.tensor(rows, dtype=torch.long), server.device)
    server.store.release(index)
    server.settings.release(index, rows)
    server.active = Active.of([s.settings for s in server.sched.holders if s is not None])
    with server.cond:
        server.cond.notify_all()
