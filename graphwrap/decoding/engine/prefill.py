"""The prompts the turn admitted, prefilled (part of the turn's run, :mod:`.loop`): their rows'
block tables written, then each routed (:func:`.pieces.route`): a long prompt that finds no row
decoding in one forward, other long prompts and those found cached to pieces, and the rest in
batches of like width, each batch one forward, then each sequence's first token
(:mod:`.first_token`). A batch whose forward raises is tried a prompt at a time, so a prompt that
makes the model raise fails its own call alone."""

from typing import List

from ..cache.pages import PagedStore
from . import captures, pieces
from .first_token import first_tokens, rows_of
from .scheduler import Seq


def prefill_admitted(server, seqs: List[Seq]):
    """The forwards of sequences the scheduler just gave a row (and blocks) each."""
    if isinstance(server.store, PagedStore):
        server.store.assign(rows_of(seqs), [s.blocks for s in seqs])
    seqs = pieces.route(server, seqs)
    for group in server.prompts.groups([s.feed for s in seqs]):
        batch = [seqs[i] for i in group]
        try:
            prefill(server, batch)
        except Exception as e:  # noqa: BLE001 - a prompt that makes the model raise fails alone
            if len(batch) == 1:
                server.end_call(batch[0].call, e)
                continue
            for s in batch:
                try:
                    prefill(server, [s])
                except Exception as e1:  # noqa: BLE001
                    server.end_call(s.call, e1)


def prefill(server, seqs: List[Seq]):
    """One forward of ``seqs``' feeds, of like width, in one bucket's shape; their first tokens."""
    rows = rows_of(seqs)
    prompts = [s.feed for s in seqs]
    shape, how = server.shapes.pick(("prefill",) + server.prompts.shape(prompts))
    inputs = server.prompts.inputs(prompts, rows, shape[1:], server.device)
    width = shape[2]
    logits = captures.forward(server, server.prefill_engine, shape, how, inputs, lambda s: s.prompt_window(width))[:len(seqs)]
    first_tokens(server, seqs, logits, inputs[1][:len(seqs)])
    server.counts["prefills"] += 1
    server.counts["prefill_rows"] += len(seqs)
