"""The decode thread's step of every live row, alone or with a piece of a long prompt in the same
forward (on the decode thread; the server's state is read and written as the turn's own).

Beside decoding rows a long prompt goes a piece a turn (:mod:`.pieces`). As two forwards, a turn
is the piece's and then the step's, each reading the model's weights: on a Llama-3-8B shape
beside 32 rows the rows' gap between tokens was 13.4 ms while a prompt was served against 5.7
(``benchmarks/results/h200-2026-11-27-step-norm/``). Where the step's attention reads the paged
pool in place and the model passed :func:`~.probe.probe_mixed`, both go through one forward
(:class:`~.step.MixedStep`): the rows' next tokens and the piece's positions as one sequence,
each at its own position, one graph per (row bucket, piece width), captured beside the decode
thread. Until a shape's graph serves (on a GPU), where its capture failed, and where the mixed
forward raises (a prompt the model refuses then fails alone, apart), the two run apart.
"""

import logging
from typing import List, Optional

import torch

from ..cache.rows import to_device
from . import captures, growth, outputs, pieces
from .grammar import before_sampling
from .sampling import logprobs
from .shapes import EAGER

logger = logging.getLogger("graphwrap")


def step(server, live: List) -> None:
    """One step of every live row (each fails with it where it raises)."""
    if server.sched.pool is not None:
        live = growth.make_room(server, live)
        if not live:
            return
    n, span = server.sched.step_shape(live)
    shape, how = server.shapes.pick(("step", n, server.store.step_span(span)))
    _, n, span = shape
    try:
        logits = captures.forward(server, server.engine, shape, how, (server.next_ids[:n],), lambda s: s.window(span))
        tokens, extra = sampled(server, logits, n, live)
    except Exception as e:  # noqa: BLE001 - the step serves every live row: each fails with it
        logger.exception("a decode step failed; its %d sequences fail with the error", len(live))
        for s in live:
            server.end_call(s.call, e)
        return
    stepped(server, live, n, tokens, extra)


def sampled(server, logits: torch.Tensor, n: int, live: List):
    """``(tokens, log-probabilities or None)`` of the first ``n`` rows from their logits. Where a
    live row has a grammar, every step queued before is read first (its matcher moves on by its
    last token) and the rows' allowed tokens are filled while this step's forward runs."""
    if server.active.grammar:
        outputs.read(server, keep=0)
        before_sampling(server, live)
    tokens = server.settings.next_tokens(logits, n, server.store.lengths[:n], server.active)
    k = server.active.logprobs
    return tokens, (logprobs(logits, tokens, k) if k >= 0 else None)


def stepped(server, live: List, n: int, tokens: torch.Tensor, extra: Optional[torch.Tensor]) -> None:
    """After a step of ``n`` rows: their next tokens in place, queued to be read, and counted."""
    server.next_ids[:n, 0] = tokens
    server.inflight.queue(live, [s.row for s in live], tokens, extra)
    server.sched.launched(live)
    server.sched.advanced(live)
    server.counts["steps"] += 1
    server.counts["step_rows"] += len(live)
    server.counts["step_padded_rows"] += n - len(live)


def together(server) -> bool:
    """A piece of the oldest long prompt and a step of every live row in one forward, where the
    batch can now; whether it did (if not, the turn runs them apart)."""
    if server.mixed_engine is None:
        return False
    s = pieces.oldest(server)
    live = server.sched.live()
    if s is None or not live:
        return False
    if server.sched.pool is not None:
        live = growth.make_room(server, live)
        if not live or s.done or s.row is None:  # (a row preempted to make room: this turn runs apart)
            return False
    n, _ = server.sched.step_shape(live)
    width = server.piece
    shape, how = server.shapes.pick(("mixed", n, width), counted=False)
    if how == EAGER:  # (its graph is queued: an eager forward of every row would cost more than the two apart)
        return False
    _, n, _ = shape
    start = s.prefilled
    end = min(start + width, len(s.feed))
    host = torch.zeros((1, width + 3), dtype=torch.long)
    host[0, :end - start] = torch.tensor(s.feed[start:end], dtype=torch.long)
    host[0, width:] = torch.tensor([start, end - start, s.row], dtype=torch.long)
    t = to_device(host, server.device)
    ids = torch.cat([server.next_ids[:n, 0], t[0, :width]])[None]
    try:
        logits = captures.forward(server, server.mixed_engine, shape, how, (ids, t[0, width:]),
                                  lambda store: store.mixed_window(n, width))
    except Exception:  # noqa: BLE001 - run apart: a prompt the model refuses then fails alone
        logger.warning("a step and a piece in one forward failed; this turn runs them apart", exc_info=True)
        server.counts["mixed_failed"] += 1
        return False
    try:
        tokens, extra = sampled(server, logits[:n], n, live)
    except Exception as e:  # noqa: BLE001 - as a step's: every live row fails with it
        logger.exception("a decode step failed; its %d sequences fail with the error", len(live))
        for seq in live:
            server.end_call(seq.call, e)
        return True
    stepped(server, live, n, tokens, extra)
    server.counts["mixed_steps"] += 1
    pieces.ran(server, s, end, logits[n:n + 1])
    return True
