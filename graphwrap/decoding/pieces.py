"""A prompt longer than the batch's chunk, prefilled a piece a turn of the decode thread, between
the other rows' steps, so that one long prompt does not stall them (each piece eager: its cost
is compute)."""

from typing import cast

import torch

from .attention import without_cudnn
from .rows import to_device


def next_piece(server):
    """One piece of the oldest long prompt (a failure is its call's own); after its last, the
    sequence's first token, and it joins the steps."""
    chunking = server.sched.chunking
    while chunking and chunking[0].done:
        chunking.popleft()
    if not chunking:
        return
    s = chunking[0]
    row, start = cast(int, s.row), cast(int, s.prefilled)
    feed = s.feed
    end = min(start + server.chunk, len(feed))
    ids = to_device(torch.tensor([feed[start:end]], dtype=torch.long), server.device)
    try:
        with server.fold, without_cudnn(server.device):
            logits = server.chunker(ids, start, server.store.chunk_window(row, start, end - start))
    except Exception as e:  # noqa: BLE001 - a prompt that makes the model raise fails alone
        chunking.popleft()
        server._end_call(s.call, e)
        return
    server.store.lengths[row] = end  # (a step's padding write there is written over by the next piece)
    s.prefilled = end
    server.counts["prefill_pieces"] += 1
    if end < len(feed):
        return
    chunking.popleft()
    s.prefilled = None
    server.store.live[row] = 1
    server._first_tokens([s], logits, to_device(torch.tensor([end], dtype=torch.long), server.device))
