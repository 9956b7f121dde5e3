"""A prompt longer than the batch's chunk, prefilled a piece a turn of the decode thread, between
the other rows' steps, so that one long prompt does not stall them.

In the paged pool a piece is :data:`~.pool.PIECE` positions beside decoding rows and
:data:`~.pool.PIECE_ALONE` with none (its weights read a quarter as often; at most a chunk,
and a row, either way: a piece's capture writes and reads its whole width), through :class:`~.step.PieceStep`,
whose graphs (one per span bucket, captured beside the decode thread like the steps', served
meanwhile by a larger one or eagerly) read the piece's place from the device: a piece then
costs the rows beside it its time on the GPU, not an eager forward's host time (about 30 ms for
an 8B model, whatever its width). In the whole-rows layout a piece is
:data:`~.step.CHUNK` positions, eager (:class:`~.step.ChunkStep`).

At most :data:`IN_FLIGHT` pieces are on the device at a time: a turn that finds that many
still running steps alone (or, with no row to step, waits for the oldest), so that a long
prompt alone does not queue all its pieces at once and hold the decode thread in a launch.
With one, the host had queued two or three steps by the time the last piece ended, and each
piece waited behind them: beside 32 decoding rows on a Llama-3-8B shape the 6,000-token prompt
took 2.10 s against 1.32 with three, the others' gaps p99 about the same (30-34 ms).

A long prompt that finds no other prompt in pieces goes in one eager forward instead
(:func:`prefill_whole`, up to :data:`WHOLE` positions), before the prompts admitted with it,
where no row decodes or where it fits the prompt tokens a turn admits beside decoding rows
(:func:`.schedule.beside_of`): those rows then wait for it once, as for a turn's short prompts.
Longer prompts beside decoding rows go in pieces, so that the rows wait a piece's share a turn.
"""

import functools
import logging
from typing import Optional, cast

import torch

from ..cache.pages import PagedStore
from ..cache.rows import to_device
from ..callers.delivery import OUTBOX
from ..kernels.attention import without_cudnn
from . import captures, schedule
from .first_token import first_tokens
from .scheduler import bucket_of

logger = logging.getLogger("graphwrap")
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
IN_FLIGHT = 3  # pieces queued on the device at most (benchmarks/results/h200-2026-11-27-pieces/, call 7)
# Positions a turn's pieces may take in all, its first included (None: one piece a turn), where
# the batch's ``decode={"prefill_budget": N}`` does not say (0 there: one piece a turn).
# Beside 32 decoding rows on a Llama-3-8B shape (H200), a 7,900-token prompt's first token came
# in 0.39 s with 2,048 against 0.64 with one piece a turn, the rows' time 1.03x, their longest
# gap 80 ms (one turn of 2,048 positions) against 23 (benchmarks/scheduler.py --budget 0,2048).
BUDGET: Optional[int] = 2048
# Positions up to which a long prompt (no other prompt in pieces, none of it found cached; beside
# decoding rows, within the turn's prompt budget) is prefilled in one eager forward of the model's own
# attention, as ``model.generate`` prefills it, where the batch's ``decode={"prefill_whole": N}``
# does not say (0 there: always in pieces). Pieces read the weights once a piece and attend
# through the paged kernel; the one forward does neither. A request that comes meanwhile waits
# for that forward's end (benchmarks/scheduler.py, part 3, measures both ways).
WHOLE = 8192
# ... and from where its forward is at least this many operations (2 x the model's weights x
# positions), where the pieces are graphs: below it an eager forward's host time (about 30 ms
# for an 8B model) outweighs what the pieces' graphs lose. On a Llama-3-8B shape (H200) a
# 1,000-token prompt alone took 0.039 s in one forward against 0.033 in pieces; 4,000 tokens
# 0.116 against 0.134 (benchmarks/results/h200-2026-11-30-whole/). 3.2e13 is 2,000 positions there.
WHOLE_FROM = 3.2e13
# Whether a long prompt within a turn's prompt budget (schedule.beside_of) goes in one forward
# beside decoding rows too, rather than in pieces. On a Llama-3-8B shape (H200), a 7,900-token
# prompt sent while 32 short requests decoded: its first token in 0.246-0.252 s against
# 0.325-0.330 in pieces (its prefill alone 0.250), the shorts 1.58-1.61x their time alone against
# 1.68-1.70x, their longest gap 197-219 ms against 69-70 (one turn's pieces of 2,048 positions);
# the process's first such prompt in pieces, its shapes captured meanwhile, made the shorts take
# 2.89x (benchmarks/scheduler.py --whole-beside 0,1 --long-after 0.15,
# benchmarks/results/h200-2026-11-30-loop/). ``decode={"prefill_beside": N}`` below a prompt's
# length sends it to pieces.
WHOLE_BESIDE = True


def route(server, seqs):
    """Of sequences just admitted, those whose feed is prefilled whole now (one long prompt
    that may go whole, :func:`goes_whole`, has been, by :func:`prefill_whole`); the others go in
    pieces: a feed longer than the chunk from its start, and one whose leading blocks were found
    cached from where they end (its row's length set there first: a step's write for the row,
    which the next piece writes over, then lands in a block of its own, never a shared one)."""
    whole, one = [], False  # (one forward of a long prompt a turn, before the others' prompts)
    for s in seqs:
        if s.cached:
            server.store.lengths[s.row:s.row + 1].fill_(s.cached)
            s.prefilled = s.cached
            server.sched.chunking.append(s)
            if s.call.cached_to is not None:  # (graphwrap's server counts them: its usage's cached_tokens)
                OUTBOX.post(s.call.box, functools.partial(s.call.cached_to, s.cached))
        elif len(s.feed) > server.chunk:
            if not one and goes_whole(server, s, seqs) and prefill_whole(server, s):
                one = True
                continue
            s.prefilled = 0
            server.sched.chunking.append(s)
        else:
            whole.append(s)
    return whole


def whole_of(server) -> int:
    """Positions up to which a long prompt is prefilled in one forward, the batch's or
    :data:`WHOLE` (0: never)."""
    return (WHOLE if server.whole_limit is None else server.whole_limit) or 0


def goes_whole(server, s, admitted=()) -> bool:
    """Whether ``s``, a long prompt just admitted, goes in one forward: within the bounds of a
    whole forward (:func:`whole_of`, :data:`WHOLE_FROM`), no other prompt in pieces, and either
    within the prompt tokens a turn admits beside decoding rows (:data:`WHOLE_BESIDE`) or no row
    decoding (the prompts ``admitted`` with it this turn do not yet: theirs are prefilled after
    its forward)."""
    n = len(s.feed)
    if n > whole_of(server) or server.sched.chunking or (_replays(server) and 2 * server.weights.count * n < WHOLE_FROM):
        return False
    if WHOLE_BESIDE:
        bound = schedule.beside_of(server)
        if not bound or n <= bound:
            return True
    new = {id(a) for a in admitted}
    return not any(h is not None and h is not s and h.needs_steps and id(h) not in new for h in server.sched.holders)


def prefill_whole(server, s) -> bool:
    """``s``'s feed in one eager forward into its row, then its first token; False (it goes in
    pieces) where the device had no memory for the forward. A failure of the model's is the
    call's own."""
    row, feed = cast(int, s.row), s.feed
    device = server.device
    ids = to_device(torch.tensor([feed], dtype=torch.long), device)
    slot = to_device(torch.tensor([row], dtype=torch.long), device)
    try:
        with server.fold, without_cudnn(device):
            logits = server.whole(ids, slot, server.store.whole_window(len(feed)))
    except _OOM:
        server.counts["whole_no_memory"] += 1
        level = logging.WARNING if server.counts["whole_no_memory"] == 1 else logging.DEBUG  # (once a batch)
        logger.log(level, "a %d-token prompt alone had no memory for one forward: it goes in pieces (logged once; "
                   "stats()['decode']['whole_no_memory'] counts every such prompt)", len(feed))
        return False
    except Exception as e:  # noqa: BLE001 - a prompt that makes the model raise fails alone
        server.end_call(s.call, e)
        return True
    server.store.lengths[row:row + 1].fill_(len(feed))
    server.store.live[row:row + 1].fill_(1)
    server.counts["whole_prefills"] += 1
    first_tokens(server, [s], logits, to_device(torch.tensor([len(feed)], dtype=torch.long), device))
    return True


def oldest(server):
    """The oldest long prompt still to prefill (those ended meanwhile dropped), or None."""
    chunking = server.sched.chunking
    while chunking and chunking[0].done:
        chunking.popleft()
    return chunking[0] if chunking else None


def next_piece(server) -> int:
    """One piece of the oldest long prompt (a failure is its call's own); after its last, the
    sequence's first token, and it joins the steps. Its width (0: none this turn)."""
    if oldest(server) is None:
        return 0
    running = server.pieces_running
    while running and running[0].query():
        running.popleft()
    if len(running) >= IN_FLIGHT:
        if server.sched.live():
            server.counts["piece_turns_skipped"] += 1  # (this turn steps alone)
            return 0
        running.popleft().synchronize()  # (no row to step meanwhile)
    width = (server.piece if server.sched.live() else server.piece_alone) if _graphs(server) else server.chunk
    piece(server, server.sched.chunking[0], width)
    return width


def more_pieces(server, spent: int):
    """Where the batch's budget (:data:`BUDGET` by default) is set: after the turn's first piece (``spent`` positions, its
    padding included), pieces of the waiting long prompts, oldest first, each
    :attr:`piece_alone <.server.DecodeServer.piece_alone>` wide, while the turn's pieces stay
    within the budget and at most :data:`IN_FLIGHT` more than the budget's are on the device:
    several prompts' pieces a turn, at the price of the decoding rows' next step waiting for
    them."""
    budget = budget_of(server)
    if not budget or not _graphs(server):
        return
    width, running = server.piece_alone, server.pieces_running
    most = IN_FLIGHT + budget // width
    while spent + width <= budget and oldest(server) is not None:
        while running and running[0].query():
            running.popleft()
        if len(running) >= most:
            return
        piece(server, server.sched.chunking[0], width)
        server.counts["budget_pieces"] += 1
        spent += width


def budget_of(server) -> int:
    """Positions a turn's pieces may take, the batch's or :data:`BUDGET` (0: one piece a turn)."""
    return (BUDGET if server.budget is None else server.budget) or 0


def _graphs(server) -> bool:
    return server.piece_engine is not None and isinstance(server.store, PagedStore)


def _replays(server) -> bool:
    """Whether the pieces replay graphs (on a CPU the piece engine runs them eagerly)."""
    return _graphs(server) and server.device.type == "cuda"


def piece(server, s, width: int):
    """The piece of ``s`` from where its prefill stands, ``width`` positions at most."""
    chunking = server.sched.chunking
    row, start = cast(int, s.row), cast(int, s.prefilled)
    feed = s.feed
    graphs = _graphs(server)
    end = min(start + width, len(feed))
    try:
        if graphs:
            logits = _replayed(server, row, start, end, feed, width)
        else:
            ids = to_device(torch.tensor([feed[start:end]], dtype=torch.long), server.device)
            with server.fold, without_cudnn(server.device):
                logits = server.chunker(ids, start, server.store.chunk_window(row, start, end - start))
    except Exception as e:  # noqa: BLE001 - a prompt that makes the model raise fails alone
        chunking.remove(s)
        server.end_call(s.call, e)
        return
    event = _ended(server)
    if event is not None:
        server.pieces_running.append(event)
    ran(server, s, end, logits)


def ran(server, s, end: int, logits: torch.Tensor):
    """After the piece of ``s`` up to ``end`` was queued (``logits``: of its last valid
    position): its row's length, and after its last piece, the sequence's first token."""
    row = cast(int, s.row)
    # (fill_: a kernel of its own; an item set from a Python number would wait for the device)
    server.store.lengths[row:row + 1].fill_(end)  # (a step's padding write there is written over by the next piece)
    s.prefilled = end
    server.counts["prefill_pieces"] += 1
    if end < len(s.feed):
        server.sched.written([s], end)  # (its blocks so far: cached for the prompts that wait on them)
        return
    server.sched.chunking.remove(s)
    s.prefilled = None
    server.store.live[row:row + 1].fill_(1)
    first_tokens(server, [s], logits, to_device(torch.tensor([end], dtype=torch.long), server.device))


def _ended(server) -> Optional[torch.cuda.Event]:
    """An event that ends with the piece just queued (on a GPU; None elsewhere)."""
    if server.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _replayed(server, row: int, start: int, end: int, feed, width: int) -> torch.Tensor:
    span = server.store.piece_span(bucket_of(end, server.sched.span_buckets))
    shape, how = server.shapes.pick(("piece", width, span))
    _, width, span = shape
    host = torch.zeros((1, width + 3), dtype=torch.long)
    host[0, :end - start] = torch.tensor(feed[start:end], dtype=torch.long)
    host[0, width:] = torch.tensor([start, end - start, row], dtype=torch.long)
    t = to_device(host, server.device)
    return captures.forward(server, server.piece_engine, shape, how, (t[:, :width], t[0, width:]),
                            lambda store: store.piece_window(width, span))
