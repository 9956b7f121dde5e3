"""Each row's next token under its own settings, for a whole step at once.

The settings live on the device, one entry per row of the cache, written when a sequence takes
its row. The processors are transformers' (a grammar's mask first, then ``sequence_bias`` of
single tokens, ``repetition_penalty``, the API's ``presence_penalty`` and ``frequency_penalty``
over the tokens made, ``min_new_tokens`` / ``min_length``, then ``temperature``, ``top_k``,
``top_p``), applied per row; greedy rows take
the highest score, sampled rows the highest score plus Gumbel noise (the same distribution as
drawing from the softmax). The noise is a hash of the sequence's seed, its position and the
token id, not a draw from a generator shared by every row, so a seeded sequence makes the same
tokens alone and in any batch, wherever its logits are the same.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ..cache.rows import to_device
from ..callers.settings import SeqSettings
from . import sampler_graphs
from .grammar import RowMasks

Tensor = torch.Tensor
M32 = 0xFFFFFFFF
EOS_WIDTH = 4  # end-of-sequence ids per row on the device at first (a request with more widens the table)


BIAS_WIDTH = 4  # biased tokens per row on the device at first (a request with more widens the table)


def _needs_history(s: SeqSettings) -> bool:
    """Whether a row's penalties read the tokens its sequence has seen."""
    return s.penalty != 1.0 or s.presence != 0.0 or s.frequency != 0.0


def hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix (in int64, values kept below 2**32)."""
    x = x & M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def gumbel(seed: Tensor, position: Tensor, vocab: int) -> Tensor:
    """Noise ``[n, vocab]`` from each row's seed and position (reproducible by construction)."""
    key = hash32(hash32(seed) ^ ((position * 0x9E3779B9) & M32))
    ids = torch.arange(vocab, device=seed.device, dtype=torch.long)
    bits = hash32(key[:, None] ^ ((ids[None, :] * 0x85EBCA6B) & M32))
    return -torch.log(-torch.log(uniform(bits)))


def uniform(bits: Tensor) -> Tensor:
    """Floats strictly inside (0, 1) from 32-bit integers: their top 23 bits, centred. (With 24 bits
    the largest, 1 - 2**-25, rounds to 1.0 in float32: its noise was +inf, which made that token the
    draw whatever its score, one id in 2**24 a step, and a token top-k, top-p or a grammar had set
    to -inf came out as NaN, which argmax takes.)"""
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


@dataclass
class Active:
    """What the live rows use, known on the host, so a step runs only the work it needs."""

    sample: bool = False
    penalty: bool = False
    min_new: bool = False
    top_k: int = 0  # the largest top_k of a sampled row (0: none)
    top_p: bool = False
    logprobs: int = -1  # the most top log-probabilities a row asks for (-1: no row wants any)
    grammar: bool = False  # a row's tokens are constrained (grammar.py)
    bias: bool = False  # a row adds a bias to some tokens' scores
    additive: bool = False  # a row has a presence or frequency penalty

    @staticmethod
    def of(settings: Sequence[SeqSettings]) -> "Active":
        a = Active()
        for s in settings:
            a.penalty |= s.penalty != 1.0
            a.min_new |= s.min_new > 0 and bool(s.eos)
            a.logprobs = max(a.logprobs, s.logprobs)
            a.grammar |= s.grammar is not None
            a.bias |= bool(s.bias)
            a.additive |= s.presence != 0.0 or s.frequency != 0.0
            if s.sample:
                a.sample = True
                a.top_k = max(a.top_k, s.top_k)
                a.top_p |= s.top_p < 1.0
        return a


def logprobs(logits: Tensor, tokens: Tensor, k: int) -> Tensor:
    """``[n, 1 + 2k]`` float32: each row's chosen token's log-probability under the model's own
    distribution (its logits' log-softmax, before temperature, top-k/p and penalties), then the
    ``k`` highest log-probabilities and their token ids (exact in float32 below 2**24)."""
    lp = logits.float().log_softmax(-1)
    out = [lp.gather(1, tokens[:, None])]
    k = min(k, lp.shape[-1])  # (a vocabulary smaller than what was asked: all of it)
    if k > 0:
        top = lp.topk(k, dim=-1)
        out += [top.values, top.indices.float()]
    return torch.cat(out, 1)


class RowSettings:
    """Per-row settings on the device, and the step's sampler.

    The settings are three tables, one row each per row of the cache (floats: temperature,
    top_p, repetition penalty; integers: top_k, min_new_tokens, the prompt's length, whether it
    samples, its seed; the end-of-sequence ids within the vocabulary, -1 for none), so that
    admitting sequences writes them with one copy to the device each; the names below are
    views of their columns. A row given back is reset to neutral settings (:meth:`release`):
    what a sequence asked for never reaches the next one in its row."""

    def __init__(self, rows: int, max_len: int, device: torch.device, vocab: int):
        d = torch.device(device)
        self.device, self.vocab = d, vocab
        self.floats = torch.ones((rows, 3), device=d)
        self.longs = torch.zeros((rows, 5), dtype=torch.long, device=d)
        self.temperature, self.top_p, self.penalty = self.floats.unbind(1)
        self.top_k, self.min_new, self.prompt_len, self.sample, self.seed = self.longs.unbind(1)
        self.eos = torch.full((rows, EOS_WIDTH), -1, dtype=torch.long, device=d)
        self.additive = torch.zeros((rows, 2), device=d)  # presence, frequency
        self.bias_ids = torch.zeros((rows, BIAS_WIDTH), dtype=torch.long, device=d)  # (padding: id 0, bias 0)
        self.bias_values = torch.zeros((rows, BIAS_WIDTH), device=d)
        self.history: Optional[Tensor] = None  # [rows, max_len] token ids, made when a row first needs a penalty
        self.max_len = max_len
        self.masks: Optional[RowMasks] = None  # the rows' allowed tokens, made when a row first has a grammar
        self.graphs = sampler_graphs.SamplerGraphs(d) if d.type == "cuda" and sampler_graphs.ENABLED else None  # a step's sampler, replayed

    def eos_of(self, s: SeqSettings) -> List[int]:
        """The end-of-sequence ids of ``s`` the model can make (an id outside the vocabulary is
        never made, as in ``generate``; gathering its score would read past the logits)."""
        return [e for e in s.eos if 0 <= e < self.vocab]

    def write(self, rows: List[int], settings: List[SeqSettings], prompts: List[List[int]],
              seeds: List[int], starts: Optional[List[int]] = None) -> Tensor:
        """Set the settings of newly admitted rows (and what they prefilled, where a penalty
        needs it); the rows' indices on the device. ``starts``: each prompt's own length where
        ``prompts`` hold tokens made before too (a preempted sequence admitted again); the
        lengths of ``prompts`` by default."""
        starts = starts if starts is not None else [len(p) for p in prompts]
        eos = [self.eos_of(s) for s in settings]
        width = max([self.eos.shape[1]] + [len(e) for e in eos])
        if width > self.eos.shape[1]:  # a request with more ids than any before: a wider table
            wider = torch.full((self.eos.shape[0], width), -1, dtype=torch.long, device=self.device)
            wider[:, :self.eos.shape[1]] = self.eos
            self.eos = wider
        longs = torch.tensor([[r, s.top_k, s.min_new, n, int(s.sample), seed & 0x7FFFFFFF] + e + [-1] * (width - len(e))
                              for r, s, n, seed, e in zip(rows, settings, starts, seeds, eos)], dtype=torch.long)
        floats = torch.tensor([[s.temperature, s.top_p, s.penalty] for s in settings], dtype=torch.float32)
        floats = torch.cat([floats, torch.tensor([[s.presence, s.frequency] for s in settings], dtype=torch.float32)], 1)
        longs, floats = to_device(longs, self.device), to_device(floats, self.device)
        idx = longs[:, 0]
        self.longs.index_copy_(0, idx, longs[:, 1:6])
        self.eos.index_copy_(0, idx, longs[:, 6:])
        self.floats.index_copy_(0, idx, floats[:, :3])
        self.additive.index_copy_(0, idx, floats[:, 3:])
        self._write_bias(idx, settings)
        if any(_needs_history(s) for s in settings):
            if self.history is None:
                self.history = torch.zeros((self.floats.shape[0], self.max_len), dtype=torch.long,
                                           device=self.device)
            for r, s, p in zip(rows, settings, prompts):
                if _needs_history(s):
                    self.history[r, :len(p)] = to_device(torch.tensor(p, dtype=torch.long), self.device)
        return idx

    def _write_bias(self, idx: Tensor, settings: List[SeqSettings]):
        """The rows' biased token ids and biases (a row of more than the table holds widens it)."""
        width = max([self.bias_ids.shape[1]] + [len(s.bias) for s in settings])
        if width > self.bias_ids.shape[1]:
            grow = width - self.bias_ids.shape[1]
            self.bias_ids = torch.cat([self.bias_ids, self.bias_ids.new_zeros((self.bias_ids.shape[0], grow))], 1)
            self.bias_values = torch.cat([self.bias_values, self.bias_values.new_zeros((self.bias_ids.shape[0], grow))], 1)
        ids = torch.zeros((len(settings), width), dtype=torch.long)
        values = torch.zeros((len(settings), width))
        for i, s in enumerate(settings):
            for j, (t, b) in enumerate(s.bias):
                ids[i, j], values[i, j] = t, b
        self.bias_ids.index_copy_(0, idx, to_device(ids, self.device))
        self.bias_values.index_copy_(0, idx, to_device(values, self.device))

    def release(self, rows: Tensor, host: Sequence[int] = ()):
        """Rows given back (``host``: the same, on the host): neutral settings (greedy, no penalty,
        no bias, no end-of-sequence hold, every token allowed)."""
        self.longs.index_fill_(0, rows, 0)
        self.eos.index_fill_(0, rows, -1)
        self.floats.index_fill_(0, rows, 1.0)
        self.additive.index_fill_(0, rows, 0.0)
        self.bias_values.index_fill_(0, rows, 0.0)
        if self.masks is not None:
            self.masks.release(list(host))

    def constrain(self, seqs: Sequence) -> tuple:
        """The allowed tokens of each constrained sequence of ``seqs`` (their matchers moved on by
        every token read), ready for the sampling queued next: the sequences whose grammar refused
        a token, and those it allows none (:meth:`RowMasks.fill`)."""
        if self.masks is None:
            self.masks = RowMasks(self.floats.shape[0], self.vocab, self.device)
        return self.masks.fill(seqs)

    def next_tokens(self, logits: Tensor, rows, lengths: Tensor, active: Active) -> Tensor:
        """The next token of each of ``rows`` (an int ``n``: the first ``n`` rows; else a tensor
        of row indices) from their logits ``[len(rows), vocab]``; ``lengths`` are the rows'
        lengths now (the position the new token takes). A step's (``n`` rows) by its sampler
        graph where it has one (:mod:`.sampler_graphs`): the tokens then stay as they are only
        until the next step's sampling."""
        if isinstance(rows, int) and self.graphs is not None:
            tokens = self.graphs.tokens(self, logits, rows, lengths, active,
                                        lambda: self.sampled(logits, rows, lengths, active, in_graph=True))
            if tokens is not None:
                return tokens
        return self.sampled(logits, rows, lengths, active)

    def sampled(self, logits: Tensor, rows, lengths: Tensor, active: Active, in_graph: bool = False) -> Tensor:
        """:meth:`next_tokens`' work, launched here (``in_graph``: inside a capture, so only
        torch's ops: a grammar's mask without XGrammar's kernel)."""
        sel = slice(0, rows) if isinstance(rows, int) else rows
        scores = logits.float()
        if active.grammar and self.masks is not None:  # (a copy of float32 logits: the log-probabilities read them)
            scores = self.masks.apply(scores.clone() if scores is logits else scores, sel, kernel=not in_graph)
        if active.bias:  # (transformers' order: sequence_bias, then repetition_penalty)
            scores = scores.scatter_add(1, self.bias_ids[sel], self.bias_values[sel])
        if active.penalty:
            scores = self._penalise(scores, sel, lengths)
        if active.additive:
            scores = self._additive(scores, sel, lengths)
        if active.min_new:
            scores = self._hold_eos(scores, sel, lengths)
        greedy = scores.argmax(-1)
        if not active.sample:
            tokens = greedy
        else:
            tokens = torch.where(self.sample[sel] != 0, self._sample(scores, sel, lengths, active), greedy)
        if self.history is not None:
            index = torch.arange(rows, device=tokens.device) if isinstance(rows, int) else rows
            self.history[index, lengths.clamp(max=self.max_len - 1)] = tokens
        return tokens

    def _penalise(self, scores: Tensor, sel, lengths: Tensor) -> Tensor:
        assert self.history is not None  # made when a row's settings first asked for a penalty
        hist = self.history[sel]
        seen = torch.arange(hist.shape[1], device=scores.device)[None, :] < lengths[:, None]
        hist = torch.where(seen, hist, hist[:, :1])  # unseen positions repeat the first token
        got = scores.gather(1, hist)
        p = self.penalty[sel][:, None]
        got = torch.where(got < 0, got * p, got / p)
        return scores.scatter(1, hist, got)

    def _additive(self, scores: Tensor, sel, lengths: Tensor) -> Tensor:
        """The API's presence and frequency penalties: each token the sequence has made (its
        prompt's not counted) loses ``presence`` once and ``frequency`` per time it was made."""
        assert self.history is not None  # (made when a row's settings first asked for one)
        hist = self.history[sel]
        at = torch.arange(hist.shape[1], device=scores.device)[None, :]
        made = (at >= self.prompt_len[sel][:, None]) & (at < lengths[:, None])
        counts = torch.zeros_like(scores).scatter_add_(1, hist, made.to(scores.dtype))
        pf = self.additive[sel]
        return scores - pf[:, 1:2] * counts - pf[:, 0:1] * (counts > 0).to(scores.dtype)

    def _hold_eos(self, scores: Tensor, sel, lengths: Tensor) -> Tensor:
        hold = (lengths - self.prompt_len[sel]) < self.min_new[sel]
        eos = self.eos[sel]
        ok = (eos >= 0) & hold[:, None]
        ids = eos.clamp(min=0, max=scores.shape[1] - 1)  # (write keeps only ids of the vocabulary)
        # The held ids' scores to -inf, the rest left as they are: the smaller of each score and
        # -inf (held) or +inf (not). A padding entry (-1) lands on id 0 beside a held id 0 (the end
        # of GPT-NeoX, Pythia, StarCoder), and the smaller value wins whatever the order of writes;
        # a scatter of both values there kept either.
        bound = torch.where(ok, float("-inf"), float("inf")).to(scores.dtype)
        return scores.scatter_reduce(1, ids, bound, reduce="amin", include_self=True)

    def _sample(self, scores: Tensor, sel, lengths: Tensor, active: Active) -> Tensor:
        scores = scores / self.temperature[sel][:, None]
        neg = torch.full((), float("-inf"), device=scores.device)
        if active.top_k:
            kmax = min(active.top_k, scores.shape[1])
            top = scores.topk(kmax, dim=-1).values
            given = self.top_k[sel]
            kth = top.gather(1, (given.clamp(min=1, max=kmax) - 1)[:, None])
            kth = torch.where(given[:, None] > 0, kth, neg)
            scores = torch.where(scores < kth, neg, scores)
        if active.top_p:
            ordered, order = scores.sort(dim=-1, descending=False)
            cum = ordered.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= (1 - self.top_p[sel][:, None])
            drop[:, -1] = False
            scores = scores.scatter(1, order, torch.where(drop, neg, ordered))
        return (scores + gumbel(self.seed[sel], lengths, scores.shape[1])).argmax(-1)
