"""The server's text of a sequence: stop strings cut wherever the pieces split them, and tokens
decoded a piece at a time give the text decoded whole (graphwrap.serve.api.text, no model)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi", reason='needs FastAPI: pip install -e ".[serve]"')

from graphwrap.serve.api.text import Detokenizer, StopText  # noqa: E402


def _cut(text, stops):
    """The text cut where, growing a character at a time, it first holds a stop string."""
    for end in range(len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return text[:end - max(len(s) for s in ending)], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc ", max_size=40), stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=4),
                                                                   max_size=3), cuts=st.lists(st.integers(0, 40)))
def test_stop_text_cuts_at_the_first_stop_string_however_the_text_is_split(text, stops, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    s = StopText(stops)
    out, hit = "", False
    for a, b in zip(bounds, bounds[1:]):
        piece, hit = s.feed(text[a:b])
        out += piece
        if hit:
            break
    if not hit:
        out += s.flush()
    assert (out, hit or s.stopped) == _cut(text, stops)


def test_the_stop_string_met_first_wins_however_the_text_comes():
    # "c" is complete before "bca" is: a token at a time or all at once, the text stops at "b"
    for pieces in (["b", "c", "a"], ["bca"]):
        s = StopText(["bca", "c"])
        out = ""
        for p in pieces:
            got, hit = s.feed(p)
            out += got
            if hit:
                break
        assert (out, hit) == ("b", True)


def test_stop_text_holds_back_only_what_could_start_a_stop_string():
    s = StopText(["</end>"])
    assert s.feed("hello <") == ("hello ", False)
    assert s.feed("/e") == ("", False)
    assert s.feed("x more") == ("</ex more", False)
    assert s.feed(" </end> after") == (" ", True)
    assert s.feed("later") == ("", True)


class _Bytes:
    """A tokenizer of one byte a token: a character of several bytes spans several tokens."""

    def decode(self, ids, **kw):
        return bytes(ids).decode("utf-8", errors="replace")


def test_the_detokenizer_gives_the_whole_text_and_never_half_a_character():
    text = "héllo 東京 ok"
    ids = list(text.encode())
    d = Detokenizer(_Bytes(), list(b"prompt "))
    pieces = [d.add([t]) for t in ids]
    assert "".join(pieces) + d.flush() == text
    assert not any("\ufffd" in p for p in pieces)
    assert [p for p in pieces if p] == ["h", "é", "l", "l", "o", " ", "東", "京", " ", "o", "k"]
    # bytes that never make a character come out as U+FFFD once no token will come
    d = Detokenizer(_Bytes(), [])
    assert d.add([0xE6]) == "" and d.add([0x9D]) == ""
    assert d.flush() == "\ufffd"
    # several tokens at once (a stream that fell behind): the same text
    d = Detokenizer(_Bytes(), [])
    assert d.add(ids[:2]) + d.add(ids[2:9]) + d.add(ids[9:]) + d.flush() == text


def test_the_fast_decode_is_the_tokenizer_s_own_and_a_class_that_changes_decode_keeps_its_own(tmp_path):
    """``decoder`` goes straight to the Rust tokenizer only where that is what ``decode`` does:
    equal text on ids with special tokens and split characters; a subclass's own decode is kept."""
    import random

    tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    import tiny_lm

    from graphwrap.serve.api.text import decoder

    tok = tr.AutoTokenizer.from_pretrained(tiny_lm.make(str(tmp_path)))
    fast = decoder(tok)
    assert fast.__code__ is not decoder(object()).__code__  # (the fast path was taken)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
        assert fast(ids) == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), ids

    class Shouting(type(tok)):
        def decode(self, ids, **kw):
            return super().decode(ids, **kw).upper()

    loud = Shouting.from_pretrained(str(tmp_path))
    ids = tok("the quick brown fox")["input_ids"]
    assert decoder(loud)(ids) == loud.decode(ids) == "THE QUICK BROWN FOX"


class _Counting(str):
    """A stop string that counts how often it is read (a character or a slice at a time)."""

    reads = 0

    def __getitem__(self, key):
        _Counting.reads += 1
        return str.__getitem__(self, key)


@pytest.mark.parametrize("text,stop", [("a" * 3000, "a" * 999 + "b"), ("ab" * 1500, "ab" * 499 + "x"),
                                       ("xyz" * 1000, "q" * 1000)], ids=["a-run", "ab-run", "no-match"])
def test_stop_strings_cost_what_the_text_is_long_not_its_square(text, stop):
    """Each character is read once whatever the stop string: trying every prefix of a stop string
    at every token (a 16,001-character stop string made a request 3.4x slower) reads it about
    len(text) x len(stop) times."""
    _Counting.reads = 0
    s = StopText([_Counting(stop)])
    out = ""
    for c in text:  # a character a token
        got, hit = s.feed(c)
        out += got
        assert not hit
    out += s.flush()
    assert out == text
    assert _Counting.reads <= 4 * (len(text) + len(stop)), _Counting.reads
