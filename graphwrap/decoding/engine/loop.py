"""The decode thread's turn: schedule, run, process outputs.

1. **Schedule** (:mod:`.schedule`): under the batch's lock, calls cancelled since the last turn end,
   and queued sequences take free rows and the pool's blocks. Only the scheduler's state changes.
2. **Run**: the device's work, queued on the batch's stream without waiting for it:
   - the admitted prompts' forwards and first tokens (:mod:`.prefill`; a long prompt that finds no
     row decoding in one forward, other long ones to pieces);
   - a piece of the oldest long prompt (:mod:`.pieces`), inside the step's forward where the batch
     can (:func:`.steps.together`);
   - one step of every live row (:mod:`.steps`), each given the block its step writes first
     (:mod:`.growth`);
   - where the prefill budget allows, more prompts' pieces.

   This part writes the device's state (block tables, the rows' next ids and settings, the tokens
   in flight) and tells the scheduler what it queued (``launched``, ``advanced``, ``written``).
3. **Process outputs** (:mod:`.outputs`): the tokens of every step but the last :data:`~.outputs.AHEAD`
   are read, each appended to its sequence's record and handed towards its call; then the rows of
   sequences that want no further step are given back.

Each part's seconds go to ``stats()["decode"]["thread_s"]`` ("prefill": the admitted prompts and
the turn's first piece, "step", "read", "retire"), and the turn's to its ``turn_ms`` and
``slowest_turns``.
"""

import time
from typing import List, Tuple

from . import outputs, pieces, steps
from .prefill import prefill_admitted
from .schedule import Turn, schedule
from .scheduler import Seq


def turn(server) -> bool:
    """One turn; False once the thread ends."""
    work = schedule(server)
    if work is None:
        return False
    if work.idle:
        return True
    clock = time.perf_counter
    t0 = clock()
    t1, live, together = run(server, work)
    t2 = clock()
    outputs.read(server, keep=outputs.AHEAD if live or together else 0)  # (a mixed step queued the rows' tokens too)
    t3 = clock()
    outputs.retire(server)
    t4 = clock()
    spent = server.spent
    spent["prefill"] += t1 - t0
    spent["step"] += t2 - t1
    spent["read"] += t3 - t2
    spent["retire"] += t4 - t3
    server.turns.add(t4 - t0, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), len(work.admitted), len(live))
    return True


def run(server, work: Turn) -> Tuple[float, List[Seq], bool]:
    """The turn's device work: ``(when its prompts and first piece were queued, the rows it
    stepped apart from a piece, whether a piece went inside the step)``."""
    if work.admitted:
        prefill_admitted(server, work.admitted)
    together = bool(server.sched.chunking) and steps.together(server)  # (a piece inside the step's forward)
    first = server.piece if together else pieces.next_piece(server) if server.sched.chunking else 0
    t1 = time.perf_counter()
    live = server.sched.live() if not together else []
    if live:
        steps.step(server, live)
    pieces.more_pieces(server, first)  # (where pieces.BUDGET is set: other prompts' pieces too)
    return t1, live, together
