"""What a ``generate`` call asks of the shared decode batch, per sequence, or why the batch
cannot serve it (the call then runs as before, taking its turn on the model).

The generation settings are transformers' own, merged as ``generate`` merges them
(``_prepare_generation_config``: the model's defaults, a ``generation_config`` passed, the
keywords). The batch serves greedy and sampled decoding with ``temperature``, ``top_k``,
``top_p``, ``repetition_penalty``, ``sequence_bias`` of single tokens, ``min_new_tokens``/``min_length``, ``eos_token_id`` and
``max_new_tokens``/``max_length``, a left-padded ``attention_mask``, several prompts per call
and a ``streamer`` for a call of one prompt; and graphwrap's own keywords, which it alone serves (a
call the batch cannot serve raises): ``grammar=`` with ``tokenizer=`` (:mod:`.grammar`),
``presence_penalty`` and ``frequency_penalty``. Any other setting that changes the tokens (beams,
``no_repeat_ngram_size``, custom processors, ...) leaves the call to transformers' loop.
"""

import copy
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

# Settings the batch applies itself.
SERVED = frozenset(("max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k",
                    "top_p", "repetition_penalty", "eos_token_id", "pad_token_id", "bos_token_id",
                    "decoder_start_token_id", "sequence_bias", "cache_implementation", "transformers_version", "_from_model_config",
                    "_commit_hash", "compile_config", "disable_compile", "cache_config", "max_cache_len",
                    "continuous_batching_config", "early_stopping", "length_penalty", "num_assistant_tokens",
                    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind",
                    "target_lookbehind", "max_matching_ngram_size", "is_assistant", "generation_kwargs"))
# Settings whose value here changes nothing (what transformers' own merge fills in): each by its
# own values, of its own type (``True == 1`` in Python, and ``no_repeat_ngram_size=1`` or
# ``forced_eos_token_id=0`` change the tokens). Any other setting is neutral only at None, False
# or empty; every other value leaves the call to the one-call loop.
_INT, _FLOAT = (int,), (int, float)
NEUTRAL: Dict[str, Tuple[Tuple[type, ...], object]] = {
    "num_beams": (_INT, 1), "num_return_sequences": (_INT, 1), "num_beam_groups": (_INT, 1),
    "no_repeat_ngram_size": (_INT, 0), "encoder_no_repeat_ngram_size": (_INT, 0),
    "diversity_penalty": (_FLOAT, 0.0), "typical_p": (_FLOAT, 1.0), "epsilon_cutoff": (_FLOAT, 0.0),
    "eta_cutoff": (_FLOAT, 0.0), "encoder_repetition_penalty": (_FLOAT, 1.0), "guidance_scale": (_FLOAT, 1.0),
    "min_p": (_FLOAT, 0.0), "penalty_alpha": (_FLOAT, 0.0),
}
# generate() keywords (not generation settings) the batch takes.
MODEL_KWARGS = frozenset(("attention_mask", "streamer"))
GRAMMAR_KWARGS = ("grammar", "tokenizer")  # graphwrap's structured output (grammar.py): the batch alone serves it
# The API's additive penalties on tokens made (no generate setting is theirs): the batch alone serves them.
PENALTY_KWARGS = ("presence_penalty", "frequency_penalty")
CACHE_IMPLEMENTATIONS = (None, "static", "dynamic")
TOP_K_MOST = 1 << 31  # a top_k past any vocabulary: larger ones are taken as this (within the device's int64)
KEEP_MERGED = 64  # merged settings kept per model
_MERGED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_MERGED_LOCK = threading.Lock()  # guards _MERGED (calls plan from many threads); never held while merging


@dataclass(slots=True)
class SeqSettings:
    """One sequence's decoding settings, as transformers would apply them."""

    max_new: int
    min_new: int = 0
    eos: Tuple[int, ...] = ()
    pad: Optional[int] = None
    sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    penalty: float = 1.0
    logprobs: int = -1  # -1: none; k >= 0: each token's log-probability and the top k (a streamer asks: calls.logprobs_of)
    grammar: Any = None  # the call's compiled grammar (grammar.py): each sequence gets a matcher of its own
    presence: float = 0.0  # subtracted from the score of each token the sequence has made (the API's presence_penalty)
    frequency: float = 0.0  # subtracted once per time it made it (frequency_penalty)
    bias: Tuple[Tuple[int, float], ...] = ()  # (token id, added to its score): sequence_bias of single tokens


@dataclass(slots=True)
class CallPlan:
    """A ``generate`` call the batch serves: its prompts (padding taken off) and settings."""

    input_ids: torch.Tensor  # a copy on the host, made when the call came (its padding kept: the output starts with it)
    prompts: List[List[int]]
    settings: SeqSettings
    streamer: Any = None
    device: torch.device = torch.device("cpu")  # where the caller's input_ids were: the output goes there


def plan_call(model, args, kwargs) -> Union[CallPlan, str]:
    """The call as the batch serves it, or why the batch does not."""
    kwargs = dict(kwargs)
    ids = kwargs.pop("input_ids", None)
    if ids is None:
        ids = kwargs.pop("inputs", None)
    if args:
        if ids is not None or len(args) > 1:
            return "positional arguments besides input_ids"
        ids = args[0]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.long, torch.int32, torch.int64):
        return "input_ids is not a 2-D tensor of token ids"
    if ids.shape[0] < 1 or ids.shape[1] < 1:
        return "an empty input_ids"
    for name in ("past_key_values", "cache"):
        if kwargs.get(name) is not None:
            return f"{name}= is given (the batch decodes into a cache of its own)"
    for name in ("logits_processor", "stopping_criteria"):
        if kwargs.pop(name, None):
            return f"{name}= is given"
    passed = {k: kwargs.pop(k) for k in MODEL_KWARGS if k in kwargs}
    additive = [float(kwargs.pop(k, None) or 0.0) for k in PENALTY_KWARGS]
    grammar, tokenizer = (kwargs.pop(k, None) for k in GRAMMAR_KWARGS) if kwargs.get("grammar") is not None else (None, None)
    gen = merged(model, kwargs)
    if isinstance(gen, str):
        return gen
    streamer = passed.get("streamer")
    if streamer is not None and ids.shape[0] != 1:
        return "a streamer with more than one prompt"
    settings = _settings(gen, ids.shape[1])
    if isinstance(settings, str):
        return settings
    if grammar is not None:
        settings.grammar = _compiled(model, grammar, tokenizer, settings)
    settings.presence, settings.frequency = additive
    asked = getattr(streamer, "logprobs", None)  # (graphwrap's own streamers: the server's)
    if asked is not None:
        settings.logprobs = int(asked)
    # A copy, taken now: the caller may refill its tensor before the call ends.
    host = ids.detach().to("cpu", copy=True)
    prompts = _prompts(host, passed.get("attention_mask"), settings)
    if isinstance(prompts, str):
        return prompts
    return CallPlan(host, prompts, settings, streamer, ids.device)


def _compiled(model, grammar, tokenizer, s: SeqSettings):
    """The call's grammar compiled for the model's scores (GrammarError where it cannot be served:
    never the one-call loop, which would not apply it)."""
    from .grammar import Grammar, GrammarError, compile_for

    if not isinstance(grammar, Grammar):
        raise GrammarError(f"grammar= takes a graphwrap Grammar (Grammar.json_schema(...), ...), not {type(grammar).__name__}")
    if s.min_new > 0:
        raise GrammarError("a grammar decides where the output ends: min_new_tokens / min_length cannot be given with it")
    return compile_for(grammar, tokenizer, out_vocab(model))


def in_vocab(model) -> int:
    """How many token ids the model's embedding takes."""
    emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    n = getattr(emb, "num_embeddings", None)
    return int(n if n is not None else model.config.vocab_size)


def out_vocab(model) -> int:
    """How many scores a step's logits hold per row (the ids the model can make)."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    n = getattr(head, "out_features", None)
    return int(n) if isinstance(n, int) else in_vocab(model)


def merged(model, kwargs: dict):
    """The merged generation config of these settings, or why the batch cannot serve them.

    transformers' merge costs about 0.7 ms of Python a call (a deep copy and a validated config
    or two), held under the GIL while the decode thread waits for it. Its result is kept per model
    and per settings of plain values, and used again while ``model.generation_config`` is as it
    was (compared by value on every call)."""
    key = _key(kwargs)
    config = getattr(model, "generation_config", None)
    entry = None
    if key is not None:
        with _MERGED_LOCK:
            entry = _MERGED.get(model, {}).get(key)
    if entry is not None and _same(entry[0], config):
        return entry[1]
    result = _merge(model, kwargs)
    snapshot = _snapshot(config) if key is not None else None
    if snapshot is not None:
        with _MERGED_LOCK:
            kept = _MERGED.setdefault(model, {})
            if len(kept) >= KEEP_MERGED:
                kept.clear()
            kept[key] = (snapshot, result)
    return result


def _merge(model, kwargs: dict):
    try:
        gen, rest = model._prepare_generation_config(kwargs.pop("generation_config", None), **kwargs)
    except Exception as e:  # noqa: BLE001 - transformers' own generate reports a bad setting best
        return f"the generation settings did not merge ({type(e).__name__}: {e})"
    unknown = sorted(k for k, v in rest.items() if v is not None)
    if unknown:
        return f"{unknown[0]}= is given"
    why = _unserved(gen)
    return why if why is not None else gen


_PLAIN = (int, float, bool, str, type(None))


def _key(kwargs: dict):
    """A hashable key of settings made of plain values (None where they are not: not kept)."""
    items = []
    for k, v in kwargs.items():
        if isinstance(v, (list, tuple)) and all(isinstance(x, _PLAIN) for x in v):
            v = (type(v).__name__,) + tuple(v)
        elif not isinstance(v, _PLAIN):
            return None
        items.append((k, type(v).__name__, v))
    return tuple(sorted(items))


def _snapshot(config):
    try:
        return copy.deepcopy(vars(config))
    except Exception:  # noqa: BLE001 - a config that cannot be copied is merged every call
        return None


def _same(snapshot, config) -> bool:
    try:
        return bool(snapshot == vars(config))
    except Exception:  # noqa: BLE001 - values that do not compare (tensors): not the same
        return False


def _unserved(gen) -> Optional[str]:
    if gen.cache_implementation not in CACHE_IMPLEMENTATIONS:
        return f"cache_implementation={gen.cache_implementation!r}"
    if gen.use_cache is False:
        return "use_cache=False"
    for key, value in sorted(gen.to_dict().items()):
        if key in SERVED or key == "use_cache":
            continue
        if not neutral(key, value):
            return f"{key}={value!r} is not served by the shared decode batch"
    return None


def neutral(key: str, value) -> bool:
    """Whether a generation setting the batch does not apply changes nothing at this value."""
    if value is None or value is False or (isinstance(value, (list, tuple, dict)) and not value):
        return True
    types_and_value = NEUTRAL.get(key)
    if types_and_value is None or isinstance(value, bool):
        return False
    types, at = types_and_value
    return isinstance(value, types) and value == at


def _settings(gen, width: int) -> Union[SeqSettings, str]:
    max_new = gen.max_new_tokens if gen.max_new_tokens is not None else (gen.max_length or 20) - width
    if isinstance(max_new, float) and max_new.is_integer():
        max_new = int(max_new)  # generate takes 5.0 as 5
    if isinstance(max_new, bool) or not isinstance(max_new, int):
        return f"max_new_tokens={max_new!r} is not a whole number"
    if max_new < 1:
        return f"max_new_tokens={max_new} (nothing to generate)"
    min_new = max(gen.min_new_tokens or 0, (gen.min_length or 0) - width)
    eos = gen.eos_token_id
    eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    if isinstance(gen.eos_token_id, torch.Tensor):
        eos = tuple(int(e) for e in gen.eos_token_id.reshape(-1).tolist())
    pad = gen.pad_token_id if gen.pad_token_id is not None else (eos[0] if eos else None)
    # (min_new past max_new holds the end for every step, as min_new = max_new does: kept so, within int64)
    s = SeqSettings(max_new=max_new, min_new=min(max(0, min_new), max_new), eos=eos, pad=pad, sample=bool(gen.do_sample))
    bias = _single_token_bias(gen.sequence_bias)
    if isinstance(bias, str):
        return bias
    s.bias = bias
    if gen.repetition_penalty is not None and gen.repetition_penalty != 1.0:
        if not gen.repetition_penalty > 0:
            return f"repetition_penalty={gen.repetition_penalty}"
        s.penalty = float(gen.repetition_penalty)
    if s.sample:
        t, k, p = gen.temperature, gen.top_k, gen.top_p
        if t is not None and t != 1.0:
            if not t > 0:
                return f"temperature={t}"
            s.temperature = float(t)
        if k is not None and k != 0:
            if k < 0:
                return f"top_k={k}"
            s.top_k = int(min(k, TOP_K_MOST))  # (more than the vocabulary keeps every token, as the most does)
        if p is not None and p != 1.0:
            if not 0 < p < 1:
                return f"top_p={p}"
            s.top_p = float(p)
    return s


def _single_token_bias(given) -> Union[Tuple[Tuple[int, float], ...], str]:
    """``sequence_bias`` as (id, bias) pairs where every biased sequence is one token (added to
    its score every step, as transformers adds it); longer sequences are the one-call loop's."""
    if not given:
        return ()
    pairs = given.items() if isinstance(given, dict) else [(tuple(k), v) for k, v in given]
    out = []
    for ids, b in pairs:
        ids = tuple(ids) if isinstance(ids, (list, tuple)) else (ids,)
        if len(ids) != 1:
            return "sequence_bias of a sequence longer than one token"
        out.append((int(ids[0]), float(b)))
    return tuple(out)


def _prompts(ids: torch.Tensor, mask, s: SeqSettings) -> Union[List[List[int]], str]:
    """Each row's tokens without its left padding (where no mask is given, transformers takes
    the pad token for padding, unless it is also an end-of-sequence token)."""
    rows = ids.tolist()
    if mask is None:
        if s.pad is not None and s.pad not in s.eos and any(s.pad in r for r in rows):
            keep = [[t != s.pad for t in r] for r in rows]
        else:
            return rows
    else:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape):
            return "an attention_mask that is not 2-D of input_ids' shape"
        keep = [[bool(v) for v in r] for r in mask.tolist()]
    prompts = []
    for r, k in zip(rows, keep):
        start = k.index(True) if True in k else len(k)
        if not all(k[start:]):
            return "an attention_mask that is not left padding (zeros, then ones)"
        if start == len(k):
            return "a row of input_ids that is all padding"
        prompts.append(r[start:])
    return prompts
