"""Turns on a model for the ``generate`` calls the shared batch does not serve, joined where they can be.

Such calls run the one-call loop one at a time per model. Calls that arrive while another runs
wait for the turn; where several of them ask for the same thing of inputs shaped alike (greedy
decoding, the same settings, inputs of one shape but the batch), the one that takes the turn
runs them all as one batch (:func:`join`) and hands each its own rows (:func:`split`), so 32
concurrent Whisper calls make about two turns, not 32. Whatever one call cannot share (sampling:
its draws are its own generator's; a streamer; a processor or criterion of its own; beams) runs
alone, as before.

A joined call's tokens are those it makes alone: each row of a batch decodes on its own (its own
encoder output, its own cache rows, its own end), and the batch's output is each row's, padded
past its end. Where the split cannot be told exactly, or the joined run fails, each call runs
again alone, so a failure (a bad input, out of memory) is its owner's only.

Decisions here are plain Python (the key, the rows each call takes, where each call's output
ends); the run itself is the one-call loop's.
"""

import dataclasses
import logging
import threading
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple, cast

import torch

logger = logging.getLogger("graphwrap")

# The tensors a call's inputs may hold: one of these (or the first positional argument), and a
# mask of the same rows.
MAIN_INPUTS = ("input_ids", "inputs", "input_features")
POSITIONAL = "*"
MASK = "attention_mask"
# Keywords whose presence (any value but None or False) keeps a call alone: per-call objects,
# per-call timing, outputs the split does not cut.
ALONE = frozenset(("streamer", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model",
                   "synced_gpus", "generation_config", "max_time", "stop_strings", "tokenizer", "negative_prompt_ids",
                   "negative_prompt_attention_mask", "decoder_input_ids", "decoder_attention_mask", "encoder_outputs",
                   "past_key_values", "cache", "inputs_embeds", "return_dict_in_generate", "output_scores",
                   "output_logits", "output_attentions", "output_hidden_states", "custom_generate",
                   "return_timestamps", "return_segments", "return_token_timestamps", "prompt_ids",
                   "prompt_condition_type", "condition_on_prev_tokens", "temperature", "compression_ratio_threshold",
                   "logprob_threshold", "no_speech_threshold", "num_return_sequences", "prompt_lookup_num_tokens",
                   "prefill_chunk_size", "assistant_early_exit"))


@dataclasses.dataclass(slots=True)
class EndsRule:
    """Where each row's own output ends in a joined batch's: ``"loop"`` (transformers' own
    ``generate``: at its first of ``eos`` from ``start``, past the prompt (a decoder-only
    model's input ids; an encoder-decoder's decoder start, seen by graphwrap's loop); at the
    last column where it has none) or ``"whisper"`` (Whisper's short-form
    ``generate``: before its trailing ``pad``s, which is its end-of-sequence token too)."""

    kind: str
    eos: Tuple[int, ...] = ()
    pad: Optional[int] = None
    start: Optional[int] = None


@dataclasses.dataclass(eq=False)
class Waiter:
    """One call waiting for its turn: its inputs, what it may be joined by, and its outcome."""

    args: tuple
    kwargs: dict
    key: Optional[tuple] = None  # None: runs alone
    module: Any = None
    rows: int = 0
    rule: Optional[EndsRule] = None
    pad: Optional[int] = None  # a text encoder-decoder's pad id: joined with calls of other lengths, padded
    done: bool = False
    result: Any = None
    error: Optional[BaseException] = None

    def outcome(self):
        if self.error is not None:
            raise self.error
        return self.result


class Turns:
    """The turn on one model: one run at a time, and the calls waiting for it."""

    def __init__(self):
        self.cond = threading.Condition()
        self.busy = False
        self.waiting: List[Waiter] = []
        self.counts = {"turns": 0, "joined_turns": 0, "joined_calls": 0, "joins_undone": 0}


_TURNS: "weakref.WeakKeyDictionary[torch.nn.Module, Turns]" = weakref.WeakKeyDictionary()
_TURNS_LOCK = threading.Lock()


def turns_of(module: torch.nn.Module, make: bool = True) -> Optional[Turns]:
    """The turn on ``module``, whichever GraphedModule runs it (None where none was made)."""
    with _TURNS_LOCK:
        t = _TURNS.get(module)
        if t is None and make:
            t = _TURNS[module] = Turns()
        return t


Run = Callable[[tuple, dict, int, Optional[List[int]]], Any]


def take(turns: Turns, me: Waiter, most_rows: int, run: Run):
    """``me``'s outcome: run in its own turn, with the waiting calls that share its key (up to
    ``most_rows`` rows in all), or by the turn of another call it was joined to. ``run(args,
    kwargs, calls, starts)`` runs one ``generate`` for ``calls`` calls (appending to ``starts``
    the prompt length of each pass of graphwrap's loop, where given)."""
    with turns.cond:
        turns.waiting.append(me)
        try:  # (turns go in the order calls came: the oldest waiting call takes the next)
            while not me.done and (turns.busy or turns.waiting[0] is not me):
                turns.cond.wait()
        except BaseException:  # (interrupted while waiting: no turn runs it for nobody)
            if me in turns.waiting:
                turns.waiting.remove(me)
                turns.cond.notify_all()
            raise
        if me.done:
            return me.outcome()
        turns.busy = True
        group = _group(turns.waiting, me, most_rows)
        for w in group:
            turns.waiting.remove(w)
        turns.counts["turns"] += 1
    try:
        _serve(turns, group, run)
    finally:
        with turns.cond:
            for w in group:  # (a KeyboardInterrupt out of _serve, say: no caller waits for good)
                if not w.done:
                    w.done = True
                    w.error = w.error or RuntimeError("the generate turn ended before this call ran")
            turns.busy = False
            turns.cond.notify_all()
    return me.outcome()


def _group(waiting: Sequence[Waiter], me: Waiter, most_rows: int) -> List[Waiter]:
    """``me`` and the oldest waiting calls of its key, up to ``most_rows`` rows in all."""
    group, rows = [me], me.rows
    if me.key is None:
        return group
    for w in waiting:
        if w is not me and w.key == me.key and rows + w.rows <= most_rows:
            group.append(w)
            rows += w.rows
    return group


def _serve(turns: Turns, group: List[Waiter], run: Run):
    if len(group) > 1:
        try:
            outs = _joined(group, run)
        except Exception as e:  # noqa: BLE001 - each call again alone: the failure is its owner's only
            first = str(e).splitlines()[0] if str(e) else ""
            logger.info("a joined generate turn of %d calls failed (%s: %s); each call runs again alone",
                        len(group), type(e).__name__, first)
            outs = None
        with turns.cond:
            if outs is not None:
                for w, out in zip(group, outs):
                    w.result, w.done = out, True
                turns.counts["joined_turns"] += 1
                turns.counts["joined_calls"] += len(group)
                turns.cond.notify_all()  # (each caller goes on at once)
                return
            turns.counts["joins_undone"] += 1
    for w in group:
        try:
            w.result = run(w.args, w.kwargs, 1, None)
        except BaseException as e:  # noqa: BLE001 - raised in the call's own thread
            w.error = e
        with turns.cond:
            w.done = True
            turns.cond.notify_all()


def _joined(group: List[Waiter], run: Run) -> Optional[list]:
    """Each call's output from one run of them all, or None where the split cannot be told (or
    the model does not mask the padded prompts a join of several lengths makes)."""
    if group[0].pad is not None and len({_width(w) for w in group}) > 1 and not pads_honoured(group[0]):
        return None
    args, kwargs, bucket = join(group)
    starts: List[int] = []
    out = run(args, kwargs, len(group), starts)
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != bucket:
        return None
    rule = group[0].rule
    if rule is not None and rule.kind == "loop" and rule.start is None:
        if len(starts) != 1:  # graphwrap's loop did not run exactly once: where the decoder's prompt ends is not known
            return None
        rule = dataclasses.replace(rule, start=starts[0])
    return split(out, [w.rows for w in group], rule)


# ------------------------------------------------------------------ padded prompts

_HONOURS: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()
PAD_CHECK = 8  # positions of padding the check adds


def _width(w: Waiter) -> int:
    return int(cast(Tuple[str, torch.Tensor], _main(w.args, w.kwargs))[1].shape[1])


def pads_honoured(w: Waiter) -> bool:
    """Whether the model's first decoder step gives the same logits for ``w``'s first prompt
    alone and right-padded (its mask zero there): that its encoder and its cross-attention
    leave padded positions out. Found once per model, in the turn (a model that reads them
    keeps joining calls of one length only)."""
    module = w.module
    found = _HONOURS.get(module)
    if found is not None:
        return found
    ids = cast(Tuple[str, torch.Tensor], _main(w.args, w.kwargs))[1][:1]
    mask = w.kwargs.get(MASK)
    mask = torch.ones_like(ids) if mask is None else mask[:1]
    pads = ids.new_full((1, PAD_CHECK), cast(int, w.pad))
    gen = module.generation_config
    start = w.kwargs.get("decoder_start_token_id", gen.decoder_start_token_id)
    if start is None:
        start = getattr(module.config, "decoder_start_token_id", None)
    ok, why = False, "it names no decoder start"
    if isinstance(start, int):
        try:
            with torch.no_grad():
                first = ids.new_full((1, 1), start)
                plain = module(input_ids=ids, attention_mask=mask, decoder_input_ids=first, use_cache=False,
                               return_dict=True).logits.float()
                pad = module(input_ids=torch.cat([ids, pads], 1), attention_mask=torch.cat([mask, mask.new_zeros(
                    (1, PAD_CHECK))], 1), decoder_input_ids=first, use_cache=False, return_dict=True).logits.float()
            tol = 1e-3 if next(module.parameters()).dtype == torch.float32 else 5e-2
            ok = bool((pad - plain).abs().max() <= tol * max(float(plain.abs().max()), 1.0))
            why = "its logits differ with padded positions masked"
        except Exception as e:  # noqa: BLE001 - a model that cannot be run so joins calls of one length only
            why = f"its forward on a padded prompt failed ({type(e).__name__})"
    _HONOURS[module] = ok
    if not ok:
        logger.info("calls of %s join only calls of their own prompt's length (%s)", type(module).__name__, why)
    return ok


# ------------------------------------------------------------------ the key, the join, the split


def waiter(module, args: tuple, kwargs: dict) -> Waiter:
    """A call as it waits for its turn, with its key where it may be joined."""
    w = Waiter(args, kwargs, module=module)
    found = _main(args, kwargs)
    if found is None:
        return w
    name, main = found
    mask = kwargs.get(MASK)
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2
                             or mask.shape[0] != main.shape[0] or mask.device != main.device):
        return w
    settings = []
    for k, v in kwargs.items():
        if k in (name, MASK):
            continue
        if k in ALONE and v is not None and v is not False:
            return w
        frozen = _frozen(v)
        if frozen is None:
            return w
        settings.append((k, frozen))
    gen = getattr(module, "generation_config", None)
    if gen is None or not _greedy(gen, kwargs):
        return w
    rule = _rule(module, gen, kwargs, main)
    if rule is None:
        return w
    kind = main.device.type
    autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) if kind in ("cuda", "cpu") else None
    w.pad = _pad_id(module, gen, kwargs, main, mask, rule)
    shape = ("any length",) if w.pad is not None else (tuple(main.shape[1:]), None if mask is None else mask.shape[1])
    w.key = (rule.kind, name, shape, main.dtype, main.device, tuple(sorted(settings)), autocast)
    w.rows, w.rule = int(main.shape[0]), rule
    return w


def _pad_id(module, gen, kwargs, main: torch.Tensor, mask, rule: EndsRule) -> Optional[int]:
    """The id a text encoder-decoder's prompt is padded with to join calls of other lengths (the
    model's pad, masked; None where the call joins only calls of its own length): where its
    model masks padded prompts (:func:`pads_honoured`, found at the first join that pads) and
    the call's mask says which positions are its own (a call without one: where its prompt
    holds no pad, which ``generate`` would mask)."""
    if rule.kind != "loop" or rule.start is not None or main.dim() != 2 or main.is_floating_point():
        return None
    if _HONOURS.get(module) is False:
        return None
    pad = kwargs.get("pad_token_id", gen.pad_token_id)
    if not isinstance(pad, int) or isinstance(pad, bool):
        return None
    if mask is None and bool((main == pad).any()):
        return None
    return pad


def _main(args: tuple, kwargs: dict) -> Optional[Tuple[str, torch.Tensor]]:
    """The call's one input tensor and where it was given (:data:`POSITIONAL` for the first
    positional argument); None where the call has another shape."""
    given = [k for k in MAIN_INPUTS if kwargs.get(k) is not None]
    if args:
        if len(args) > 1 or given:
            return None
        name, main = POSITIONAL, args[0]
    elif len(given) == 1:
        name, main = given[0], kwargs[given[0]]
    else:
        return None
    if not isinstance(main, torch.Tensor) or main.dim() < 2 or main.shape[0] < 1 or main.requires_grad:
        return None
    return name, main


def _frozen(v):
    """A hashable form of a setting's value (None where it has none: the call runs alone)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return (type(v).__name__, v)
    if isinstance(v, (list, tuple)):
        items = [_frozen(x) for x in v]
        return None if any(x is None for x in items) else ("seq", tuple(items))
    return None


def _greedy(gen, kwargs) -> bool:
    """Whether the call decodes greedily, one beam, one sequence a row (its settings over the
    model's): any other call's tokens depend on its own draws or on the other rows."""
    def setting(name, default):
        v = kwargs.get(name, getattr(gen, name, default))
        return default if v is None else v

    return (setting("do_sample", False) is False and setting("num_beams", 1) == 1
            and setting("num_return_sequences", 1) == 1 and setting("num_beam_groups", 1) == 1
            and not setting("penalty_alpha", 0) and not setting("max_time", None))


def _rule(module, gen, kwargs, main: torch.Tensor) -> Optional[EndsRule]:
    """How a call's output is cut from a batch's, for this model; None where its ``generate``
    is one of its own that graphwrap does not know."""
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:
        return None
    if getattr(type(module), "generate", None) is GenerationMixin.generate:
        # A decoder-only model's output starts with its prompt (an encoder-decoder's with the
        # decoder's start, which graphwrap's loop sees)
        start = None if getattr(module.config, "is_encoder_decoder", False) else int(main.shape[1])
        return EndsRule("loop", eos=_eos_set(kwargs.get("eos_token_id", gen.eos_token_id)), start=start)
    if type(module).__module__.startswith("transformers.models.whisper."):
        pad = kwargs.get("pad_token_id", gen.pad_token_id)
        eos = _eos_set(kwargs.get("eos_token_id", gen.eos_token_id))
        window = 2 * int(getattr(module.config, "max_source_positions", 0))
        # Short-form only (one pass, no segments), and a pad that is the end-of-sequence token:
        # Whisper strips a row's pads and its end from each row before padding the batch, so a
        # row's own output never ends with a pad, and the batch's row is it, padded.
        if (isinstance(pad, int) and eos == (pad,) and main.dim() == 3 and main.shape[-1] <= window
                and not getattr(gen, "return_timestamps", False)):
            return EndsRule("whisper", pad=pad)
    return None


def _eos_set(eos) -> Tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, torch.Tensor):
        return tuple(int(x) for x in eos.reshape(-1).tolist())
    return tuple(int(x) for x in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def bucket_of(rows: int) -> int:
    """Rows a joined batch is padded to (a power of two): a cache and graphs per bucket, not per count."""
    b = 1
    while b < rows:
        b *= 2
    return b


def join(group: Sequence[Waiter]) -> Tuple[tuple, dict, int]:
    """``(args, kwargs, rows)`` of one call over every call's rows, padded to :func:`bucket_of`
    rows with copies of the last row (their output is dropped)."""
    first = group[0]
    total = sum(w.rows for w in group)
    bucket = bucket_of(total)

    def joined(parts: List[torch.Tensor]) -> torch.Tensor:
        if bucket > total:
            last = parts[-1][-1:]
            parts = parts + [last.expand(bucket - total, *last.shape[1:])]
        return torch.cat(parts)

    args, kwargs = first.args, dict(first.kwargs)
    mains = [cast(Tuple[str, torch.Tensor], _main(w.args, w.kwargs))[1] for w in group]
    masks = [w.kwargs.get(MASK) for w in group]
    if first.pad is not None and (len({m.shape[1] for m in mains}) > 1 or any(m is not None for m in masks)):
        mains, masks = padded(mains, masks, first.pad)
    if args:
        args = (joined(mains),)
    else:
        name = next(k for k in MAIN_INPUTS if kwargs.get(k) is not None)
        kwargs[name] = joined(mains)
    if masks[0] is not None:
        kwargs[MASK] = joined(cast(List[torch.Tensor], masks))
    return args, kwargs, bucket


def padded(ids: List[torch.Tensor], masks: List[Optional[torch.Tensor]], pad: int):
    """Prompts of several lengths right-padded with ``pad`` to the longest, and their masks (ones
    where a call gave none) with zeros."""
    width = max(t.shape[1] for t in ids)
    dtype = next((m.dtype for m in masks if m is not None), torch.long)
    out_ids, out_masks = [], []
    for t, m in zip(ids, masks):
        m = torch.ones(t.shape, dtype=dtype, device=t.device) if m is None else m.to(dtype)
        extra = width - t.shape[1]
        out_ids.append(torch.cat([t, t.new_full((t.shape[0], extra), pad)], 1) if extra else t)
        out_masks.append(torch.cat([m, m.new_zeros((m.shape[0], extra))], 1) if extra else m)
    return out_ids, out_masks


def split(out: torch.Tensor, rows: Sequence[int], rule: Optional[EndsRule]) -> Optional[List[torch.Tensor]]:
    """Each call's own output (its rows, up to where the last of them ends) from a joined
    batch's ``out`` ``[bucket, length]``; None where the rule cannot tell."""
    if rule is None or (rule.kind == "loop" and (rule.start is None or rule.start > out.shape[1])):
        return None
    host = out.tolist()
    outs, at = [], 0
    for n in rows:
        end = max(row_end(host[r], rule) for r in range(at, at + n))
        outs.append(out[at:at + n, :end].clone())
        at += n
    return outs


def row_end(row: List[int], rule: EndsRule) -> int:
    """Where one row's own output ends in a joined batch's row."""
    if rule.kind == "loop":
        for i in range(cast(int, rule.start), len(row)):
            if row[i] in rule.eos:
                return i + 1
        return len(row)
    end = len(row)
    while end > 0 and row[end - 1] == rule.pad:
        end -= 1
    return end
