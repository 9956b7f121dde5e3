"""Logits processors as graphwrap's decode loop runs them: ``generate``'s own, with their host
work done once per request instead of every step.

transformers' list calls each processor in turn after reading each one's signature again, every
step; :func:`processing` reads them once. The processors that only put ``-inf`` on fixed tokens
at some lengths (suppressed tokens, suppressed first tokens, the end token before a minimum
length: Whisper's generation config adds all four) build their token mask anew every step, an
``arange`` and an ``isin`` each, a dozen small kernels launched from the host. Here each mask is
made once per request, and a run of such processors is one ``torch.where`` a step over the
masks that apply at that length: the same scores, since ``-inf`` put on a token twice is
``-inf`` once.

A masking processor is recognised by its class and by the text of its ``__call__``'s body,
whose fingerprints are below (the same from transformers 5.14 to 5.24). A release that changes
that text, and any subclass, keeps the processor's own call: slower, never other scores.
``tests/test_processors_cpu.py`` fails on such a release, to say the fingerprints want a look.
"""

import ast
import hashlib
import inspect
import math
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

import torch


@dataclass(frozen=True)
class Masking:
    """What a masking processor does: ``-inf`` on the tokens its attribute ``tokens`` holds,
    at the lengths of ``input_ids`` where ``applies`` says so."""

    tokens: str
    applies: Callable[[Any, int], bool]
    prints: FrozenSet[str]  # fingerprints (body_print) of the __call__ bodies that do just that


def _min_length(p, n: int) -> bool:
    return n < p.min_length


def _min_new_tokens(p, n: int) -> bool:
    return n - p.prompt_length_to_skip < p.min_new_tokens


def _at_begin(p, n: int) -> bool:
    return n == p.begin_index


def _always(p, n: int) -> bool:
    return True


MASKING: Dict[str, Masking] = {
    "MinLengthLogitsProcessor": Masking("eos_token_id", _min_length, frozenset({"590ef4ba68d53c3f"})),
    "MinNewTokensLengthLogitsProcessor": Masking("eos_token_id", _min_new_tokens, frozenset({"e821d9eea00a5f06"})),
    "SuppressTokensAtBeginLogitsProcessor": Masking("begin_suppress_tokens", _at_begin,
                                                    frozenset({"3ae46399f86a470a"})),
    "SuppressTokensLogitsProcessor": Masking("suppress_tokens", _always, frozenset({"97b57949409e5616"})),
}


def body_print(fn) -> Optional[str]:
    """A fingerprint of a function's body: its lines, stripped, without the signature and the
    decorators (so a change of annotations alone keeps it); None where the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        node = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(node, ast.FunctionDef) or not node.body:
        return None
    lines = source.splitlines()[node.body[0].lineno - 1:]
    text = "\n".join(line.strip() for line in lines if line.strip())
    return hashlib.sha1(text.encode()).hexdigest()[:16]


_KNOWN: Dict[tuple, Optional[Masking]] = {}  # per processor class and __call__, asked once


def masking(p) -> Optional[Masking]:
    """What ``p`` masks, where it is a masking processor graphwrap knows; else None."""
    t = type(p)
    seen = (t, t.__call__)
    if seen in _KNOWN:
        return _KNOWN[seen]
    rule = None
    try:
        from transformers.generation import logits_process
    except ImportError:
        logits_process = None
    cls = getattr(logits_process, t.__name__, None) if logits_process is not None else None
    if cls is t and t.__name__ in MASKING:
        known = MASKING[t.__name__]
        if body_print(t.__call__) in known.prints:
            rule = known
    _KNOWN[seen] = rule
    return rule


class Masks:
    """A run of masking processors: their masks made on first use, one ``torch.where`` a step."""

    def __init__(self, run: List[Tuple[Any, Masking]]):
        # A processor with no tokens to mask changes nothing: left out.
        self.run = [(p, m) for p, m in run if getattr(p, m.tokens).numel()]
        self.joined: Dict[tuple, torch.Tensor] = {}

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[-1]
        flags = tuple(m.applies(p, n) for p, m in self.run)
        if not any(flags):
            return scores
        key = (flags, scores.shape[-1], scores.device)
        mask = self.joined.get(key)
        if mask is None:
            mask = self.joined[key] = self._join(flags, scores)
        return torch.where(mask, -math.inf, scores)

    def _join(self, flags, scores: torch.Tensor) -> torch.Tensor:
        vocab = torch.arange(scores.shape[-1], device=scores.device)
        mask = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
        for (p, m), on in zip(self.run, flags):
            if on:
                mask |= torch.isin(vocab, getattr(p, m.tokens).to(scores.device))
        return mask


def processing(processors):
    """``processors(input_ids, scores)``, as transformers' list calls it: each processor in
    turn, runs of masking processors joined (:class:`Masks`). A list whose processors want more
    than the two arguments, or a list of another kind, keeps its own call (and its error)."""
    try:
        calls = list(processors)
        plain = all(len(inspect.signature(p.__call__).parameters) <= 2 for p in calls)
    except (TypeError, ValueError):
        return processors
    if not plain or type(processors).__call__ is not _list_call():
        return processors
    steps = _steps(calls)

    def process(input_ids, scores):
        for s in steps:
            scores = s(input_ids, scores)
        return scores
    return process


def _steps(calls) -> list:
    out: list = []
    run: List[Tuple[Any, Masking]] = []
    for p in calls:
        m = masking(p)
        if m is not None and isinstance(getattr(p, m.tokens, None), torch.Tensor):
            run.append((p, m))
            continue
        if run:
            out.append(Masks(run))
            run = []
        out.append(p)
    if run:
        out.append(Masks(run))
    return out


def _list_call():
    from transformers.generation.logits_process import LogitsProcessorList

    return LogitsProcessorList.__call__
