"""What the HTTP app generates with: the shared decode batch in this process
(:class:`~.local.Local`), or in a process of its own (:class:`~.remote.Remote`, what ``python -m
graphwrap serve`` runs).

Both take a sequence as token ids and ``generate``'s keywords and hand its new tokens to a
:class:`Feed` as they come; both answer with a future that ends in :class:`Ended` (or the
call's error) and whose ``cancel()`` frees the sequence's row at the batch's next step. This
module holds what the two sides share, and imports no torch: the server's process starts its
engine process before it imports torch.
"""

from dataclasses import dataclass
from typing import Any, List, Optional, Protocol

from ...decoding.callers.errors import Closed, QueueFull
from ...errors import GraphwrapError

SUBMITTERS = 8  # threads that queue calls (a call the batch cannot serve runs whole in one)


class Unservable(GraphwrapError):
    """A request the batch cannot take as it is (the client's to change)."""


class EngineGone(GraphwrapError):
    """The process that generates ended: no request can be served (the server must be restarted)."""


class Failed(RuntimeError):
    """A sequence's call failed in the engine's process; ``kind`` names what it raised there."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Ended:
    """How a sequence ended: its new tokens' count and the last token (-1 where none)."""

    count: int
    last: int


class Feed(Protocol):
    """Where a sequence's tokens go. A feed with a ``logprobs`` attribute other than None (k)
    asks for each token's log-probability and the step's k most likely tokens: ``add`` then gets
    them beside the tokens, one ``(log-probability, [(id, log-probability), ...])`` each."""

    def add(self, tokens: List[int], logprobs: Optional[List[Any]] = None) -> None: ...  # new tokens, in order
    def end(self) -> None: ...  # no more tokens (always called, however the sequence ends)


@dataclass(frozen=True)
class ModelInfo:
    """What requests are set against: the model's end-of-sequence ids and the sampling settings
    of its generation config (what a request leaves out)."""

    eos: List[int]
    generation: Any  # an object with do_sample, temperature, top_p, top_k (or None)
    vocab: Optional[int] = None  # token ids the model takes (its input embedding's rows), where it says


def model_vocab(model) -> Optional[int]:
    """How many token ids ``model`` takes: its input embedding's rows (else its config's vocab_size)."""
    embed = getattr(model, "get_input_embeddings", None)
    rows = getattr(embed() if callable(embed) else None, "num_embeddings", None)
    if isinstance(rows, int):
        return rows
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def model_eos(model) -> List[int]:
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def error_kind(e: BaseException) -> str:
    """How an error at queueing crosses to the HTTP side (:func:`queue_error` makes it again)."""
    if isinstance(e, QueueFull):
        return "queue_full"
    if isinstance(e, Closed):
        return "closed"
    if isinstance(e, GraphwrapError):  # the request itself: too long for the cache, ids past the vocabulary
        return "unservable"
    return type(e).__name__


def queue_error(kind: str, message: str) -> BaseException:
    return {"queue_full": QueueFull, "closed": Closed, "unservable": Unservable,
            "gone": EngineGone}.get(kind, lambda m: Failed(kind, m))(message)
