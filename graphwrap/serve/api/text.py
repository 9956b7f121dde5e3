"""A sequence's text as its tokens come: decoded a piece at a time, and cut at a stop string.

:class:`Detokenizer` decodes the new tokens against a few before them (a tokenizer's first
token of a text decodes differently from the same token after others: a word's leading space),
and holds back a piece that ends inside a character (bytes of UTF-8 split over tokens decode to
U+FFFD until the rest comes). :class:`StopText` passes text on, holding back the end that could
be the start of a stop string, and cuts at the first stop string the text meets (it is not part
of the text, as the API has it).
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

    def flush(self) -> str:
        """What is held back, once no token will come."""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):] if len(now) > len(before) else ""


class StopText:
    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
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
        # The stop string that a text growing a character at a time would meet first: the one that
        # ends first (the longer where two end together), so that the cut is the same however the
        # text was split into pieces.
        found = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in self.stops) if i >= 0]
        if found:
            self.held, self.stopped = "", True
            return text[:min(found)[1]], True
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self, text: str = "") -> str:
        """The rest of the text, once no token will come (cut at a stop string in ``text``)."""
        out, _ = self.feed(text)
        if self.stopped:
            return out
        rest, self.held = self.held, ""
        return out + rest
