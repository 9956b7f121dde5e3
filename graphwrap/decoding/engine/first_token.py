"""A sequence's start in its row, on every path that prefills a prompt (a batch of prompts, a long
prompt's last piece, a long prompt in one forward): its settings written into its row on the
device, its first token sampled from its prompt's last logits and queued to be read, and the
scheduler told (its blocks written, one token launched)."""

import logging
from typing import List, Optional, Tuple, cast

import torch

from .grammar import before_sampling
from .sampling import Active, logprobs
from .scheduler import Seq

logger = logging.getLogger("graphwrap")


def first_tokens(server, seqs: List[Seq], logits: torch.Tensor, lengths: torch.Tensor):
    """Each sequence's settings written into its row and its first token queued, from its
    prompt's last logits (``lengths``: the prompts' lengths, on the device)."""
    index, kept = write_settings(server, seqs)
    if len(kept) < len(seqs):  # (a sequence whose settings could not be written ended alone)
        if not kept:
            return
        at = torch.tensor([i for i, s in enumerate(seqs) if s in kept], device=logits.device)
        seqs, logits, lengths = kept, logits[at], lengths[at]
    server.sched.written(seqs)
    server.active = Active.of([s.settings for s in server.sched.holders if s is not None])
    if server.active.grammar:
        before_sampling(server, seqs)
    tokens = server.settings.next_tokens(logits, index, lengths, server.active)
    server.next_ids[index, 0] = tokens
    server.inflight.queue(seqs, list(range(len(seqs))), tokens, _logprobs(server.active, logits, tokens))
    server.sched.launched(seqs)


def write_settings(server, seqs: List[Seq]) -> Tuple[torch.Tensor, List[Seq]]:
    """The sequences' settings written into their rows: ``(their rows on the device, the
    sequences written)``. Where the rows cannot be written together, each is written alone, and a
    sequence whose own cannot be fails alone (its call ends with the error): no request's
    settings end another's, on any path that admits a sequence."""
    try:
        return server.settings.write(rows_of(seqs), [s.settings for s in seqs], [s.feed for s in seqs],
                                     [s.seed for s in seqs], [len(s.prompt) for s in seqs]), seqs
    except Exception as e:  # noqa: BLE001 - one sequence's settings: its call's failure alone
        if len(seqs) == 1:
            logger.warning("a sequence's settings could not be written into its row: its call fails (%s)", e)
            server.end_call(seqs[0].call, e)
            return torch.empty(0, dtype=torch.long, device=server.device), []
    kept, index = [], []
    for s in seqs:
        got, ok = write_settings(server, [s])
        kept += ok
        index.append(got)
    return torch.cat(index), kept


def rows_of(seqs: List[Seq]) -> List[int]:
    """The rows of sequences that hold one (every sequence admitted)."""
    return cast(List[int], [s.row for s in seqs])


def _logprobs(active: Active, logits: torch.Tensor, tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """The rows' log-probabilities where a live row asked for them (:func:`sampling.logprobs`)."""
    return logprobs(logits, tokens, active.logprobs) if active.logprobs >= 0 else None
