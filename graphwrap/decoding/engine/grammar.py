"""Structured output in the shared batch: a row whose call gives a grammar (a JSON schema, any
JSON, a regular expression, a choice of strings, or an EBNF grammar) may make only the tokens it
allows.

The grammar engine is XGrammar (``pip install xgrammar``, imported only where a call gives a
grammar). A call's grammar is compiled in the caller's thread, against the call's tokenizer and
the model's vocabulary (compilers and their caches kept per tokenizer:
:mod:`graphwrap.decoding.callers.grammar`); each sequence then has a matcher of its own, on the host. Before a step's sampling the decode thread reads the rows' last
tokens (so a batch with a constrained row keeps one step queued ahead, not two), moves each
constrained row's matcher on by its token and fills the row's bitmask of allowed tokens (32
tokens a word) while the step's forward runs on the device; one copy takes the bitmasks there,
and the sampler sets every token the mask does not allow to -inf, before penalties, temperature,
top-k and top-p. Rows without a grammar pay nothing while no live row has one.

A constrained row ends at the grammar's end: its end-of-sequence token is the only one allowed
once the grammar is complete (a model without one ends where the grammar can go no further).
"""

from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..callers.grammar import GrammarError, xgrammar

Tensor = torch.Tensor
# Threads XGrammar fills a step's masks with. One: on an H200 host, 16 rows of a 32,000-token
# vocabulary took 0.40 ms a step with one and 0.80 ms with eight (benchmarks/structured.py).
FILL_THREADS = 1


def _take_pending(live: Sequence[Any]) -> List[Any]:
    """Each matcher moved on by its tokens read since its last mask: the sequences it refused."""
    broken: List[Any] = []
    while True:
        now = [s for s in live if s.matcher.pending and s not in broken]
        if not now:
            return broken
        ok = xgrammar().BatchGrammarMatcher.batch_accept_token([s.matcher.m for s in now],
                                                               [s.matcher.pending.pop(0) for s in now])
        for s, good in zip(now, ok):
            s.matcher.ended = s.matcher.m.is_terminated()
            if not good:
                broken.append(s)


class Matcher:
    """One sequence's place in its grammar, on the host. Its tokens are taken as they are read
    and moved into the matcher with the other rows' before the next mask is filled (one call
    for every row); a grammar without an end-of-sequence token takes each at once, so that the
    sequence ends where the grammar does."""

    __slots__ = ("m", "ended", "pending", "at_once")

    def __init__(self, compiled, eos: Sequence[int]):
        xgr = xgrammar()
        eos = list(eos)
        self.m = xgr.GrammarMatcher(compiled, override_stop_tokens=eos or None, terminate_without_stop_token=not eos)
        self.ended = False
        self.pending: List[int] = []
        self.at_once = not eos

    def made(self, token: int) -> bool:
        """The sequence made ``token``; False where the grammar does not allow it (known at once
        only where the matcher takes tokens at once)."""
        if not self.at_once:
            self.pending.append(token)
            return True
        ok = bool(self.m.accept_token(token))
        self.ended = self.m.is_terminated()
        return ok


def matchers(seqs: Sequence[Any], compiled, eos: Sequence[int]) -> None:
    """A matcher of its own for each sequence of a call with a grammar."""
    for s in seqs:
        s.matcher = Matcher(compiled, eos)


def before_sampling(server, seqs: Sequence[Any]) -> None:
    """The allowed tokens of each live constrained sequence of ``seqs`` ready for the sampling
    queued next. A sequence whose token its grammar refused fails alone (a bug of the masks), and
    so does one whose grammar allows no token of the vocabulary where it stands (what the grammar
    asks for cannot be written in the tokenizer's tokens)."""
    broken, stuck = server.settings.constrain(seqs)
    for s in broken:
        server.end_call(s.call, GrammarError("a token the call's grammar does not allow was sampled "
                                              "(a bug of the batch's masks: please report it)"))
    for s in stuck:
        server.end_call(s.call, GrammarError(
            f"the call's grammar allows no token of the tokenizer after {len(s.tokens)} tokens: what it asks "
            f"for cannot be written in this vocabulary"))


class RowMasks:
    """The rows' bitmasks of allowed tokens: filled on the host (pinned where the batch is on a
    GPU), copied to the device once a step, applied to the step's scores. A row without a
    grammar allows every token (all bits set)."""

    def __init__(self, rows: int, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, torch.device(device)
        words = (vocab + 31) // 32
        on_gpu = self.device.type == "cuda"
        self.host = torch.full((rows, words), -1, dtype=torch.int32, pin_memory=on_gpu)
        self.table = torch.full((rows, words), -1, dtype=torch.int32, device=self.device) if on_gpu else self.host
        ids = torch.arange(vocab, device=self.device)
        self.word, self.bit = ids >> 5, (ids & 31).to(torch.int32)
        self.copied: Optional[torch.cuda.Event] = torch.cuda.Event() if on_gpu else None
        self.kernel = on_gpu  # XGrammar's kernel applies the masks on a GPU (one launch; else torch's ops)
        self.constrained: set = set()  # rows whose host bitmask is not all ones
        self.batch = xgrammar().BatchGrammarMatcher(FILL_THREADS)

    def _wait(self):
        if self.copied is not None:
            self.copied.synchronize()  # (the last copy read the host rows about to be written)

    def fill(self, seqs: Sequence[Any]) -> Tuple[List[Any], List[Any]]:
        """Each live constrained sequence's tokens read so far taken by its matcher (one call for
        every row), then its bitmask for its next token filled in its row (one call of XGrammar's
        for every row, on :data:`FILL_THREADS` threads), copied to the device (rows up to the
        highest): ``(the sequences whose tokens their grammar refused, those it allows no token)``,
        both left out."""
        live = [s for s in seqs if s.matcher is not None and not s.done and s.row is not None]
        broken = _take_pending(live)
        live = [s for s in live if s not in broken and not s.matcher.ended]
        if not live:
            return broken, []
        self._wait()
        rows = [s.row for s in live]
        self.batch.batch_fill_next_token_bitmask([s.matcher.m for s in live], self.host, rows)
        self.constrained.update(rows)
        some = self.host[rows].ne(0).any(1).tolist()
        stuck = [s for s, ok in zip(live, some) if not ok]
        if self.copied is not None:
            top = max(rows) + 1
            self.table[:top].copy_(self.host[:top], non_blocking=True)
            self.copied.record()
        return broken, stuck

    def release(self, rows: List[int]) -> None:
        """Rows given back allow every token again."""
        back = [r for r in rows if r in self.constrained]
        if not back:
            return
        self._wait()
        for r in back:
            self.host[r].fill_(-1)
            self.constrained.discard(r)
        if self.copied is not None:
            index = torch.tensor(back, dtype=torch.long, device=self.device)
            self.table.index_fill_(0, index, -1)

    def apply(self, scores: Tensor, sel, kernel: bool = True) -> Tensor:
        """``scores`` ``[n, vocab]`` of rows ``sel`` with every token their masks forbid at -inf
        (in place where XGrammar's kernel does it; ``kernel=False``: torch's ops, as a sampler
        graph captures them)."""
        if self.kernel and kernel:
            try:
                xgrammar().apply_token_bitmask_inplace(scores, self.table[sel], vocab_size=scores.shape[1])
                return scores
            except ImportError:  # (no Triton): torch's ops from now on
                self.kernel = False
        words = self.table[sel][:, self.word[:scores.shape[1]]]
        allowed = ((words >> self.bit[:scores.shape[1]]) & 1).bool()
        return scores.masked_fill(~allowed, float("-inf"))
