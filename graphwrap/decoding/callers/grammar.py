"""What a call's output must match (``grammar=``): the grammar as the caller gives it, checked
where a request arrives and compiled against the call's tokenizer (XGrammar, imported only where
a call gives a grammar). Plain Python: the server's HTTP side imports it without torch. The
decode thread's side (each sequence's matcher, the rows' masks) is
:mod:`graphwrap.decoding.engine.grammar`."""

import json
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Sequence, Union

from ...errors import GraphwrapError

KINDS = ("json", "json_schema", "regex", "choice", "ebnf")
_COMPILERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> {vocab: GrammarCompiler}
_COMPILERS_LOCK = threading.Lock()


class GrammarError(GraphwrapError, ValueError):
    """A grammar that does not compile (a schema XGrammar cannot read, a bad regular expression),
    or one given where it cannot be served."""


@dataclass(frozen=True)
class Grammar:
    """What a call's output must match: ``Grammar.json_schema(schema)``, ``Grammar.json()``,
    ``Grammar.regex(pattern)``, ``Grammar.choice([...])`` or ``Grammar.ebnf(text)``. Plain text
    inside (picklable, hashable): compiled where the call is planned. JSON is written compact
    (one space after ``:`` and ``,``, no other whitespace between tokens)."""

    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"a grammar's kind is one of {', '.join(KINDS)}, not {self.kind!r}")

    @staticmethod
    def json_schema(schema: Union[str, Dict[str, Any]]) -> "Grammar":
        return Grammar("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @staticmethod
    def json() -> "Grammar":
        return Grammar("json")

    @staticmethod
    def regex(pattern: str) -> "Grammar":
        return Grammar("regex", pattern)

    @staticmethod
    def choice(options: Sequence[str]) -> "Grammar":
        if isinstance(options, str) or not options or not all(isinstance(o, str) for o in options):
            raise GrammarError("Grammar.choice takes a non-empty list of strings")
        return Grammar("choice", json.dumps(list(options)))


def xgrammar():
    try:
        import xgrammar as xgr
    except ImportError as e:
        raise GrammarError("structured output needs XGrammar: pip install xgrammar "
                           "(or pip install 'graphwrap[grammar]')") from e
    return xgr


def check(grammar: Grammar) -> None:
    """GrammarError where ``grammar`` cannot compile, found without a tokenizer (a request's
    schema checked where it arrives)."""
    xgr = xgrammar()
    _compiling(grammar, lambda: _parse(xgr, grammar))


def _compiling(grammar: Grammar, make):
    """``make()``, XGrammar's own errors (RuntimeError, ValueError, ...) raised as GrammarError."""
    try:
        return make()
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever XGrammar raises for a grammar it cannot read
        raise GrammarError(f"the {grammar.kind} does not compile: {_first_line(e)}") from e


def _parse(xgr, g: Grammar):
    if g.kind == "json":
        return xgr.Grammar.builtin_json_grammar()
    if g.kind == "json_schema":
        return _strings_without_controls(xgr, xgr.Grammar.from_json_schema(g.spec, any_whitespace=False,
                                                                           strict_mode=True))
    if g.kind == "regex":
        return xgr.Grammar.from_regex(g.spec)
    if g.kind == "choice":
        options = json.loads(g.spec)
        body = " | ".join(json.dumps(o) for o in options)  # (a JSON string is an EBNF string literal)
        return xgr.Grammar.from_ebnf(f"root ::= {body}")
    return xgr.Grammar.from_ebnf(g.spec)


# XGrammar 0.2.9 writes a string with minLength or maxLength as characters of this class, which lets
# control characters (U+0000 to U+001F) in: JSON has them only escaped, so such output did not parse
# (found by benchmarks/structured.py's random schemas). The class without them, in the grammar's text.
_LOOSE_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\0-\x1f\"\\\r\n]'


def _strings_without_controls(xgr, grammar):
    text = str(grammar)
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _JSON_CHARS)) if _LOOSE_CHARS in text else grammar


def compile_for(grammar: Grammar, tokenizer, vocab: int):
    """``grammar`` compiled for ``tokenizer``'s tokens over a vocabulary of ``vocab`` logits."""
    if tokenizer is None:
        raise GrammarError("grammar= needs the tokenizer of the model's tokens: generate(..., tokenizer=tok)")
    xgr = xgrammar()
    compiler = _compiler(xgr, tokenizer, vocab)
    return _compiling(grammar, lambda: compiler.compile_grammar(_parse(xgr, grammar)))


def _compiler(xgr, tokenizer, vocab: int):
    with _COMPILERS_LOCK:
        try:
            kept = _COMPILERS.setdefault(tokenizer, {})
        except TypeError:  # (an object that takes no weak reference: a compiler for this call alone)
            kept = {}
        compiler = kept.get(vocab)
        if compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
            compiler = kept[vocab] = xgr.GrammarCompiler(info)
        return compiler


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
