"""A sequence's text as its tokens come: decoded a piece at a time, and cut at a stop string.

:class:`Detokenizer` decodes the new tokens against a few before them (a tokenizer's first
token of a text decodes differently from the same token after others: a word's leading space),
and holds back a piece that ends inside a character (bytes of UTF-8 split over tokens decode to
U+FFFD until the rest comes). :class:`StopText` passes text on, holding back the end that could
be the start of a stop string, and cuts at the first stop string the text meets (it is not part
of the text, as the API has it), reading each character once.
"""

from typing import Callable, List, Optional, Sequence, Tuple

CONTEXT = 5  # tokens of the prompt decoded before the first new one


def decoder(tokenizer) -> Callable[[List[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)``,
    straight to its Rust tokenizer where its class adds nothing to that call (a fast tokenizer
    whose ``decode`` and ``_decode`` are transformers' own): a fifth of the cost, and a stream
    decodes twice for every piece."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # (a tokenizer of another library: its own decode)
        PreTrainedTokenizerFast = PreTrainedTokenizerBase = None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (PreTrainedTokenizerFast is not None and isinstance(tokenizer, PreTrainedTokenizerFast) and backend is not None
            and cls._decode is PreTrainedTokenizerFast._decode and cls.decode is PreTrainedTokenizerBase.decode):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class Detokenizer:
    def __init__(self, tokenizer, prompt: Sequence[int], decode: Optional[Callable[[List[int]], str]] = None):
        self._decode = decode or decoder(tokenizer)
        self.ids: List[int] = list(prompt[-CONTEXT:])
        self.prefix = 0  # ids[prefix:read] decoded to the text already given out (with what came before)
        self.read = len(self.ids)

    def add(self, tokens: List[int]) -> str:
        """The text that ``tokens`` add (empty while a character is incomplete)."""
        self.ids.extend(tokens)
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def would_add(self, token: int) -> str:
        """The text ``token`` would add now (what :meth:`add` would give, held-back characters
        included), without adding it: an alternative token's text in its place."""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:] + [token])
        return now[len(before):] if len(now) > len(before) else ""

    def flush(self) -> str:
        """What is held back, once no token will come."""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):] if len(now) > len(before) else ""


class StopText:
    """Stop strings found in text that comes a piece at a time, at a cost linear in the text:
    each stop string has a matcher (Knuth-Morris-Pratt's table) that reads each character once
    and knows how much of the text's end could still begin the stop string; that much, at the
    most over the stop strings, is held back. No prefix of the text is tried again or copied."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.tables = [_table(s) for s in self.stops]
        self.states = [0] * len(self.stops)  # per stop string: its characters the text now ends with
        self.firsts = {s[0] for s in self.stops}
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> Tuple[str, bool]:
        """``(text to give out, whether a stop string ended the sequence)``."""
        if self.stopped:
            return "", True
        text = self.held + text
        if not self.stops:
            self.held = ""
            return text, False
        # Only the new characters are read: the held ones were read before (the matchers' states).
        base = len(self.held)
        states, stops, tables, firsts = self.states, self.stops, self.tables, self.firsts
        for at in range(base, len(text)):
            c = text[at]
            if c not in firsts and not any(states):
                continue
            # The stop string that a text growing a character at a time meets first: the one that
            # ends first (the longer where two end together), so that the cut is the same however
            # the text was split into pieces.
            cut = None
            for i, s in enumerate(stops):
                k = states[i]
                while k and s[k] != c:
                    k = tables[i][k - 1]
                if s[k] == c:
                    k += 1
                if k == len(s):
                    start = at + 1 - k
                    cut = start if cut is None else min(cut, start)
                    k = tables[i][k - 1]
                states[i] = k
            if cut is not None:
                self.held, self.stopped = "", True
                return text[:cut], True
        keep = max(states)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self, text: str = "") -> str:
        """The rest of the text, once no token will come (cut at a stop string in ``text``)."""
        out, _ = self.feed(text)
        if self.stopped:
            return out
        rest, self.held = self.held, ""
        return out + rest


def _table(s: str) -> List[int]:
    """For each prefix of ``s``, the length of its longest proper prefix that is also its suffix."""
    table = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        if s[i] == s[k]:
            k += 1
        table[i] = k
    return table
