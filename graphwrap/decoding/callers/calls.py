"""A ``generate`` call in the shared decode batch, as its caller sees it: its record, how it
ends (its streamer's tokens and end, then its result or error, delivered off the decode
thread), and the errors a caller gets where the batch takes no call (:mod:`.errors`)."""

import logging
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from ...errors import GraphwrapError
from ..cache.pool import CachePlan, blocks_for
from ..engine.scheduler import Seq
from .delivery import Mailbox
from .logprobs import Logprobs
from .settings import CallPlan

logger = logging.getLogger("graphwrap")


@dataclass(eq=False)
class Call:
    """One ``generate`` call: its future, its sequences and what its result is built from."""

    plan: CallPlan
    future: Future
    box: Mailbox
    seqs: List[Seq] = field(default_factory=list)
    left: int = 0
    error: Optional[BaseException] = None
    ended: bool = False  # set once, by end_call (the decode thread)
    queued: bool = False  # set once, when enqueued: counted among the batch's calls in flight until it ends
    sink: Any = None  # its streamer's sink, where it has one (:class:`Sinks`)
    cached_to: Any = None  # its streamer's ``put_cached(n)``, where it has one: prompt tokens found cached

    def __post_init__(self):
        self.sink = getattr(self.plan.streamer, "sink", None)
        self.cached_to = getattr(self.plan.streamer, "put_cached", None)


def put_token(call: Call, streamer, token: int, made: float = 0.0, lag: Optional[Deque[float]] = None,
              lp: Optional[Logprobs] = None):
    """A token to a call's streamer (none once the call was cancelled or failed): as a list of
    one int to a streamer that has ``put_ids`` (graphwrap's server has), else as generate's
    streamers take it, a tensor. A tensor made per token costs the delivery worker torch calls
    that each let go of the GIL, and taking it back waits for whichever thread took it (up to the
    interpreter's switch interval, 5 ms): with the decode thread and a server's threads busy, a
    step's tokens then reach their streams one every few milliseconds. ``lag`` gets the seconds
    from ``made`` (the step that made it read it) to its delivery. ``lp``: its log-probabilities
    where its streamer asked, to ``put_ids`` only, unpacked (:meth:`Logprobs.unpack`)."""
    if call.error is None and not call.future.done():
        put_ids = getattr(streamer, "put_ids", None)
        if put_ids is not None:
            put_ids([token]) if lp is None else put_ids([token], [lp.unpack()])
        else:
            streamer.put(torch.tensor([token]))
        if lag is not None:
            lag.append(time.perf_counter() - made)


def finish(call: Call, error: Optional[BaseException]):
    """A call's last delivery: its streamer ended (a cancelled or failed call's too, so that a
    consumer waiting on it is let go), then its result or error."""
    streamer = call.plan.streamer
    if streamer is not None:
        try:
            streamer.end()
        except BaseException as e:  # noqa: BLE001 - the call's own error comes first
            error = error if error is not None else e
    if call.future.done():
        return
    if error is None:
        try:
            result = _result(call)
        except Exception as e:  # noqa: BLE001 - the call fails with it: never a future left unset
            error = GraphwrapError(f"the output of this generate call could not be built ({type(e).__name__}: {e})")
            call.error = error
    try:
        if error is not None:
            call.future.set_exception(error)
        else:
            call.future.set_result(result)
    except InvalidStateError:  # cancelled meanwhile
        pass


def _result(call: Call) -> torch.Tensor:
    """``generate``'s output: the input as given when the call came, then each row's tokens,
    padded at the end."""
    width = max(len(s.tokens) for s in call.seqs)
    pad = call.plan.settings.pad
    rows = []
    for s in sorted(call.seqs, key=lambda s: s.index):
        rows.append(s.tokens + [pad if pad is not None else 0] * (width - len(s.tokens)))
    new = torch.tensor(rows, dtype=torch.long)
    return torch.cat([call.plan.input_ids.long(), new], dim=1)


def check_call(plan: CallPlan, max_len: int, positions: Optional[int], cache: CachePlan, vocab: int,
               scores: Optional[int] = None):
    """GraphwrapError for a call a batch of ``max_len`` positions a sequence cannot hold, or with
    token ids outside the model's ``vocab`` (``scores``: the ids its logits score, where fewer:
    a biased id must be one of them)."""
    longest = max(len(p) for p in plan.prompts)
    need = longest + plan.settings.max_new
    if need > max_len:
        if positions is not None and need > positions:
            fix = f"the model has {positions} positions: pass fewer tokens"
        else:
            fix = f"pass fewer tokens, or GraphedModule(..., decode={{'max_len': {need}}})"
        raise GraphwrapError(
            f"a prompt of {longest} tokens and max_new_tokens={plan.settings.max_new} need {need} positions of "
            f"the decode cache, which holds {max_len} per sequence: {fix}")
    if cache.paged and blocks_for(need, cache.block) > cache.most - cache.scratch:
        raise GraphwrapError(
            f"a prompt of {longest} tokens and max_new_tokens={plan.settings.max_new} need {need} positions; the "
            f"decode cache holds {cache.positions} in all (decode={{'cache_memory': ...}} sets its share of "
            f"the GPU's free memory)")
    bad = [t for p in plan.prompts for t in p if not 0 <= t < vocab]
    if bad:
        raise GraphwrapError(f"token id {bad[0]} is outside the model's vocabulary of {vocab}")
    bad = [t for t, _ in plan.settings.bias if not 0 <= t < min(vocab, scores or vocab)]
    if bad:
        raise GraphwrapError(f"sequence_bias names token id {bad[0]}, outside the model's vocabulary of {vocab}")
    pad = plan.settings.pad
    if pad is not None and pad not in plan.settings.eos and not 0 <= pad < vocab:
        raise GraphwrapError(f"pad_token_id={pad} is outside the model's vocabulary of {vocab}")


class Sinks:
    """Tokens for graphwrap's own consumers, handed over on the decode thread, a turn's at once.

    A streamer with a ``sink`` (an object with ``put_step(keys, tokens)`` that never blocks: the
    server's engine process has one) and a ``key`` gets its tokens this way, not one delivery
    each on a worker: at the end of the turn each sink gets every token of its calls in one
    call, before the turn's ends and results are posted to the workers (so a call's last token
    reaches the sink before its result). The workers' share of the interpreter, which the decode
    thread waits for, then holds no per-token work for these calls. The prompt, ``end`` and
    results still go the workers' way. A sink that raises fails the calls whose tokens it lost
    (``on_error``), as a streamer that raises does. Where a call asked for log-probabilities,
    ``put_step`` gets a third list: each token's, packed (:class:`Logprobs`), None for the others."""

    def __init__(self, lag: Deque[float], on_error: Callable[[Call, BaseException], None]):
        self.pending: Dict[Any, Tuple[List[Any], List[int], List[Call], List[Optional[Logprobs]]]] = {}
        self.made: Optional[float] = None  # when the turn's first token was read
        self.lag, self.on_error = lag, on_error

    def add(self, call: Call, token: int, made: float, lp: Optional[Logprobs] = None):
        if call.error is not None or call.future.done():  # (cancelled or failed: no token after)
            return
        got = self.pending.get(call.sink)
        if got is None:
            got = self.pending[call.sink] = ([], [], [], [])
            self.made = made if self.made is None else self.made
        got[0].append(call.plan.streamer.key)
        got[1].append(token)
        got[2].append(call)
        got[3].append(lp)

    def flush(self):
        if not self.pending:
            return
        pending, self.pending = self.pending, {}
        for sink, (keys, tokens, calls, lps) in pending.items():
            try:
                sink.put_step(keys, tokens) if not any(lps) else sink.put_step(keys, tokens, lps)
            except BaseException as e:  # noqa: BLE001 - the decode thread lives on; those calls fail
                logger.exception("a token sink raised: its %d calls of this turn fail", len(set(calls)))
                for call in set(calls):
                    self.on_error(call, e)
        if self.made is not None:
            self.lag.append(time.perf_counter() - self.made)
            self.made = None
