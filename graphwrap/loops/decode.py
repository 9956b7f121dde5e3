"""graphwrap's decode loop for Hugging Face ``generate``: greedy and sampled decoding whose steps
replay graphs, with no wait on the GPU between steps.

``generate`` prepares everything as it always does (the generation config, the logits
processors and stopping criteria, the cache, the prompt's inputs) and hands the loop that
:func:`make_decode_loop` makes to its public ``custom_generate`` hook. The loop runs the prompt's
forward eagerly (its length changes every call, and padding it would write padded positions
into the cache), then every step through graphwrap's engine: the step's inputs are the model's
own (``prepare_inputs_for_generation``), kept from step to step where the cache allows it
(:func:`lean_inputs`), and the processors and criteria are ``generate``'s. Where transformers'
loop reads "are all rows finished?" back from the GPU after every step, this one queues steps
ahead and reads that flag a few steps late, without waiting: steps queued after the last row
finished are dropped (their tokens cut off, the random generator put back where it stood), so
the tokens and their count are ``generate``'s own.

Requests the loop does not serve (beams, streamers, returned scores, an assistant) are run by
transformers' own loop: its greedy and sampling loops hand each step to graphwrap, beam search
calls the model itself. ``stats()["generate"]`` counts how each call's steps ran
(:meth:`GraphedModule.generate`).
"""

import inspect
import logging
from typing import Any, Dict, List, Optional, Tuple, Union, cast

import torch

from ..errors import GraphwrapError
from . import seq2seq
from .experts import batched_experts
from .processors import processing
from .repeat import Repeat
from .window import RingMasks, is_ring, ring_unsupported, use_rings

logger = logging.getLogger("graphwrap")

# How many steps the loop queues between two looks at the "all rows finished" flags.
POLL_EVERY = 8

# generate() keywords that the loop does not serve: transformers' own loop runs these requests.
NOT_SERVED = ("streamer", "assistant_model", "synced_gpus", "custom_generate", "prompt_lookup_num_tokens",
              "return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
              "output_hidden_states", "prefill_chunk_size", "inputs_embeds", "tokenizer", "stop_strings")


def cache_keyword(module) -> str:
    """The keyword ``generate``, ``prepare_inputs_for_generation`` and the forward take the cache
    by: ``cache`` from transformers 5.24 (``past_key_values`` still accepted there, with a
    deprecation warning), ``past_key_values`` before."""
    prepare = getattr(module, "prepare_inputs_for_generation", None)
    try:
        params = inspect.signature(prepare).parameters if prepare is not None else {}
    except (TypeError, ValueError):
        params = {}
    return "cache" if "cache" in params else "past_key_values"


def given_cache(kwargs):
    """The cache a ``generate`` call was given, by either keyword."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def unsupported(module) -> Optional[str]:
    """Why graphwrap's loop cannot run this model's ``generate`` (None when it can)."""
    try:
        import transformers.generation.utils as gen_utils
    except ImportError:
        return "transformers is not installed"
    mixin = getattr(gen_utils, "GenerationMixin", None)
    if mixin is None or not isinstance(module, mixin):
        return "not a Hugging Face generation model"
    if not _takes_custom_generate(module, mixin):
        return "this transformers has no custom_generate (a callable decoding loop needs 4.56 or newer)"
    for name in ("_prefill", "_update_model_kwargs_for_generation", "prepare_inputs_for_generation"):
        if not callable(getattr(module, name, None)):
            return f"this transformers' models have no {name}()"
    if not _takes_next_length(module.prepare_inputs_for_generation):
        return "this transformers' prepare_inputs_for_generation() takes no next_sequence_length"
    return None


def _takes_next_length(prepare) -> bool:
    """Whether a model's ``prepare_inputs_for_generation`` takes ``next_sequence_length``: as a
    parameter, or in ``**kwargs`` it hands on to transformers' own (Whisper's adds decoder
    positions first). An override that keeps its ``**kwargs`` for the forward does not."""
    try:
        params = inspect.signature(prepare).parameters
    except (TypeError, ValueError):
        return False
    if "next_sequence_length" in params:
        return True
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return False
    try:
        source = inspect.getsource(prepare)
    except (OSError, TypeError):
        return False
    return "super().prepare_inputs_for_generation(" in source and "**kwargs" in source.split("super().", 1)[1]


def _takes_custom_generate(module, mixin) -> bool:
    """Whether ``generate`` takes ``custom_generate``: as a parameter, or through the ``**kwargs``
    of a model's own ``generate`` that hands them to transformers' (Whisper's)."""
    params = inspect.signature(module.generate).parameters
    if "custom_generate" in params:
        return True
    passes = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return passes and "custom_generate" in inspect.signature(mixin.generate).parameters


def request_unsupported(kwargs) -> Optional[str]:
    """Why graphwrap's loop does not serve this ``generate`` call (None when it does)."""
    for name in NOT_SERVED:
        if kwargs.get(name) not in (None, False):
            return f"{name}= is given"
    if kwargs.get("num_beams", 1) not in (None, 1) or kwargs.get("num_return_sequences", 1) not in (None, 1):
        return "beam search or several sequences per prompt"
    if kwargs.get("use_cache") is False:
        return "use_cache=False"
    return None


def check_room(args, kwargs):
    """A GraphwrapError, before any step, where a static cache passed to ``generate`` is too
    short for the prompt and ``max_new_tokens`` (its last steps would write past its end: an
    index error of the model's, on a GPU a device-side assert that ends the process's CUDA
    context)."""
    cache, new = given_cache(kwargs), kwargs.get("max_new_tokens")
    ids = kwargs.get("input_ids", args[0] if args else None)
    if cache is None or not isinstance(new, int) or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return
    if getattr(cache, "cross_attention_cache", None) is not None:
        return  # an encoder-decoder's: input_ids are the encoder's, not what its self-attention holds
    if getattr(cache, "is_compileable", False) is not True:
        return  # a cache that grows
    if any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", None) or []):
        return  # a sliding window keeps its last positions: it never runs out
    length = None
    for name in ("get_max_length", "get_max_cache_shape"):
        if callable(getattr(cache, name, None)):
            try:
                length = getattr(cache, name)()
            except Exception:  # noqa: BLE001 - a length that cannot be told is not checked
                return
            break
    if not isinstance(length, int) or length <= 0:
        return
    if ids.shape[1] + new > length:
        raise GraphwrapError(
            f"the cache passed to generate holds {length} positions, and this call needs {ids.shape[1] + new} "
            f"({ids.shape[1]} of input_ids and max_new_tokens={new}): pass a cache of max_cache_len >= "
            f"{ids.shape[1] + new}, fewer max_new_tokens, or cache_implementation=\"static\" and no cache "
            "(graphwrap then sizes its own cache)")


# Token ids a call may set that generate feeds to the model or writes into its scores by index.
ID_SETTINGS = ("pad_token_id", "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id")


def check_ids(module, args, kwargs):
    """A GraphwrapError, before any forward, for token ids past the model's embedding or its
    scores: the prompt's (``input_ids``, ``decoder_input_ids``) and the ids a call sets that
    ``generate`` feeds back as inputs or writes by index (a pad, a decoder start, a forced
    token). On a GPU any of them is a device-side assert that ends the process's CUDA context
    for every caller; an end-of-sequence id outside the vocabulary is only never made."""
    embed = getattr(module, "get_input_embeddings", None)
    rows = getattr(embed() if callable(embed) else None, "num_embeddings", None)
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    limits = [n for n in (rows, vocab) if isinstance(n, int) and n > 0]
    if not limits:
        return
    most = min(limits)
    main = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    for name, ids in (("input_ids", main), ("decoder_input_ids", kwargs.get("decoder_input_ids"))):
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.numel():
            low, high = torch.stack(torch.aminmax(ids)).tolist()  # (one wait for the device)
            if low < 0 or high >= most:
                raise GraphwrapError(f"{name} holds token id {low if low < 0 else high}, outside the model's "
                                     f"vocabulary of {most}")
    for name in ID_SETTINGS:
        ids = kwargs.get(name)
        for t in ids if isinstance(ids, (list, tuple)) else [ids]:
            if isinstance(t, int) and not 0 <= t < most:
                raise GraphwrapError(f"{name}={t} is outside the model's vocabulary of {most}")


def _mode_unsupported(model, gen) -> Optional[str]:
    if gen.num_beams not in (None, 1) or (gen.num_return_sequences or 1) != 1:
        return "beam search or several sequences per prompt"
    if gen.return_dict_in_generate:
        return "return_dict_in_generate"
    if getattr(gen, "prefill_chunk_size", None) is not None:
        return "chunked prefill"
    return None


class _Rng:
    """The random generator's state before each sampled step, so that steps dropped after the
    last row finished give back the random numbers they drew."""

    def __init__(self, device: torch.device):
        self.device = device
        self.states: List[torch.Tensor] = []

    def save(self):
        if self.device.type == "cuda":
            self.states.append(torch.cuda.get_rng_state(self.device))
        else:
            self.states.append(torch.get_rng_state())

    def rewind(self, step: int):
        """Put the generator back to where it stood before ``step``'s draw."""
        if step >= len(self.states):
            return
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(self.states[step], self.device)
        else:
            torch.set_rng_state(self.states[step])


class _Finished:
    """Per step, which rows were still unfinished after it; whether every row had finished is
    read a few steps late, never waited for."""

    def __init__(self, device: torch.device):
        self.device = device
        self.unfinished: List[torch.Tensor] = []  # per step, a bool per row
        self.pending: Optional[Tuple[torch.Tensor, torch.cuda.Event]] = None  # (pinned flag, event) of the last look, not yet read

    def add(self, unfinished: torch.Tensor) -> bool:
        """Note this step's rows; True once an earlier step is known to have finished every row."""
        self.unfinished.append(unfinished)
        if self.device.type != "cuda":
            return not bool(unfinished.any())
        if self.pending is not None and self.pending[1].query():
            done = bool(self.pending[0])
            self.pending = None
            if done:
                return True
        if self.pending is None and len(self.unfinished) % POLL_EVERY == 0:
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            # the last step of the window is enough: a finished row stays finished
            host.copy_(~unfinished.any(), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending = (host, event)
        return False

    def first(self) -> Optional[int]:
        """The first step after which every row had finished (None if none); waits for the GPU."""
        if not self.unfinished:
            return None
        hit = (~torch.stack(self.unfinished).any(1)).nonzero()
        return int(hit[0, 0]) if hit.numel() else None


# What a decode step's inputs may hold for them to be kept from step to step (the cache under
# either keyword: see cache_keyword).
LEAN_KEYS = frozenset(("input_ids", "past_key_values", "cache", "attention_mask", "position_ids", "use_cache",
                       "logits_to_keep"))


def lean_inputs(model, inputs: dict, model_kwargs: dict) -> Optional[dict]:
    """The first decode step's inputs, kept for every step (:func:`_lean`); None where the
    model's own preparation must run each step."""
    got = _lean(model, inputs, model_kwargs)
    return got[0] if got is not None else None


def _lean(model, inputs: dict, model_kwargs: dict) -> Optional[Tuple[dict, int]]:
    """``(inputs, the column of the new token in their 2D mask)``, or None.

    ``prepare_inputs_for_generation`` turns the 2D mask into a 4D mask over the whole static
    cache each step, on the host. Given the 2D mask extended to the cache's length instead, the
    model's forward builds that same mask itself, inside the graph: each step then changes the
    new tokens, the mask's column of the new position (:meth:`_StepInputs.next` sets it; the
    columns past it stay 0, so a model whose attention is not causal reads no empty slot) and,
    where the model takes them, positions one further. Only for a cache of full-attention layers
    whose 4D mask spans it whole: a sliding window reads the 2D mask of the whole sequence at an
    offset of its own."""
    if hasattr(model, "create_masks_for_generate") or not set(inputs) <= LEAN_KEYS:
        return None  # masks of the model's own for generate, or inputs the loop does not know
    mask, mask2d = inputs.get("attention_mask"), model_kwargs.get("attention_mask")
    ids, pos = inputs.get("input_ids"), inputs.get("position_ids")
    if mask2d is None and isinstance(mask, torch.Tensor) and mask.dim() == 4 and isinstance(ids, torch.Tensor):
        # No padding: transformers 5.24 keeps no 2D mask then (5.17 kept one of ones): every
        # position the cache holds, and the new token's, is real.
        seen = getattr(given_cache(inputs), "get_seq_length", lambda: None)()
        if seen is None:
            return None
        mask2d = torch.ones(ids.shape[0], int(seen) + 1, dtype=torch.long, device=ids.device)
    if (not isinstance(mask, torch.Tensor) or not isinstance(mask2d, torch.Tensor) or mask.dim() != 4
            or mask2d.dim() != 2 or mask.shape[-1] < mask2d.shape[-1] or ids is None or ids.shape[-1] != 1
            or (pos is not None and pos.shape[-1] != 1)):
        return None
    cache = given_cache(inputs)
    layers = getattr(cache, "layers", None) or []
    if not layers or any(getattr(layer, "is_sliding", True) for layer in layers):
        return None  # a sliding window reads the 2D mask of the whole sequence at its own offset
    try:
        whole = cache.get_max_length()
    except Exception:  # noqa: BLE001 - a cache whose length cannot be told keeps the model's preparation
        return None
    if whole != mask.shape[-1]:
        return None  # the 4D mask does not span the whole cache
    rows, length = mask2d.shape
    lean = dict(inputs)
    lean["attention_mask"] = torch.cat([mask2d, mask2d.new_zeros(rows, mask.shape[-1] - length)], dim=1)
    return lean, length - 1


class _StepInputs:
    """The inputs of each decode step: the model's own preparation once, then kept and moved
    on by one token (:func:`lean_inputs`, or the loop's own masks over a cache with ring
    layers: :mod:`.window`), or prepared every step."""

    def __init__(self, model, model_kwargs: dict):
        self.model, self.kwargs = model, model_kwargs
        self.seq2seq = seq2seq.is_seq2seq(model)
        # An override of the preparation that takes next_sequence_length only in **kwargs (it adds
        # inputs of its own, then hands on to transformers'): prepared every step, never kept.
        prepare = getattr(model, "prepare_inputs_for_generation", None)
        own = "next_sequence_length" in inspect.signature(prepare).parameters if prepare is not None else False
        # (An encoder-decoder's steps are kept only where they hold nothing but the tokens, the
        # cache and the encoder's output and mask: seq2seq.LeanSteps.)
        # None: not known yet; False: prepared every step; else the kept inputs (a dict, or an
        # encoder-decoder's LeanSteps) and the mask's last column set (2D masks).
        self.lean: Union[None, bool, Dict[str, Any], seq2seq.LeanSteps] = None if own or self.seq2seq else False
        self.column = 0
        self.masks: Optional[RingMasks] = None  # over a cache with ring layers over a cache with ring layers
        self.rings = [layer for layer in getattr(given_cache(model_kwargs), "layers", None) or [] if is_ring(layer)]

    def after(self, outputs):
        """Note a forward's outputs (the cache, and the mask and positions one token longer)."""
        if not self.lean:
            self.kwargs = self.model._update_model_kwargs_for_generation(outputs, self.kwargs,
                                                                         is_encoder_decoder=self.seq2seq)

    def prefill(self, input_ids, gen) -> torch.Tensor:
        """The prompt's forward, eagerly (``generate``'s own): its logits."""
        outputs = self.model._prefill(input_ids, gen, self.kwargs)
        self.after(outputs)
        return outputs.logits

    def step(self, step, input_ids, tokens) -> torch.Tensor:
        """The next decode step's logits (a view of a graph's output where the inputs are kept:
        valid until the next step)."""
        kw = self.next(input_ids, tokens)
        if self.kept:
            return step.logits(kw)
        outputs = (step if self.graphed else self.model)(**{**kw, "return_dict": True})
        self.after(outputs)
        return outputs.logits

    @property
    def graphed(self) -> bool:
        """Whether the steps may go to graphwrap's engine: a cache with ring layers only with the
        loop's masks (without them its steps read the position on the host: the model runs them)."""
        return not self.rings or self.masks is not None

    def next(self, input_ids, tokens) -> dict:
        lean = self.lean
        if isinstance(lean, seq2seq.LeanSteps):
            return lean.next(tokens)
        if isinstance(lean, dict):
            lean["input_ids"] = tokens[:, None]
            if "position_ids" in lean:
                lean["position_ids"] = lean["position_ids"] + 1
            if self.masks is not None:
                self.masks.step()
            else:  # the new token's column of the 2D mask (lean_inputs)
                self.column += 1
                lean["attention_mask"][:, self.column] = 1
            return lean
        inputs = self.model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **self.kwargs)
        if self.lean is None:
            if self.seq2seq:
                steps = seq2seq.LeanSteps.make(self.model, inputs, input_ids.shape[1])
                self.lean = steps or False
                if steps:
                    return _kept(steps.inputs)
            elif self.rings:
                kept = self._ring_inputs(inputs)
                self.lean = kept or False
                if kept:
                    return _kept(kept)
            else:
                made = _lean(self.model, inputs, self.kwargs)
                self.lean = made[0] if made else False
                if made:
                    self.column = made[1]
                    return _kept(made[0])
        return inputs

    def _ring_inputs(self, inputs: dict) -> Optional[dict]:
        mask2d, ids = self.kwargs.get("attention_mask"), inputs.get("input_ids")
        if (not set(inputs) <= LEAN_KEYS or not isinstance(ids, torch.Tensor) or ids.shape[-1] != 1
                or not isinstance(mask2d, torch.Tensor) or mask2d.dim() != 2
                or mask2d.shape[1] - 1 != int(self.rings[0].cumulative_length)):
            return None
        cache = given_cache(inputs)
        config = self.model.config
        self.masks = RingMasks(cache, mask2d, self.model.dtype, config._attn_implementation,
                               per_type=len(self.rings) < len(cache.layers))
        for layer in self.rings:
            layer.ring_masks = True
        return dict(inputs, attention_mask=self.masks.inputs())

    @property
    def kept(self) -> bool:
        """Whether each step's inputs are the one dict, moved on in place but for the new tokens
        (and positions): the steps go to the engine through a :class:`~.repeat.Repeat`."""
        return bool(self.lean) and self.graphed

    def close(self):
        for layer in self.rings:
            layer.ring_masks = False


def _kept(inputs: dict) -> dict:
    """Inputs kept for every step, asking for a ModelOutput (the loop reads its logits)."""
    inputs["return_dict"] = True
    return inputs


def make_decode_loop(step, own_cache=None, declined=None, starts=None):
    """A ``custom_generate`` callable whose decode steps are ``step(**model_inputs)``, or
    ``step.logits(model_inputs)`` where the loop keeps the inputs from step to step (:class:`Step`);
    ``own_cache(model, input_ids, model_kwargs)`` may put a cache of graphwrap's own in place of the one
    ``generate`` made (an encoder-decoder's: :mod:`.seq2seq`). A request it hands to
    transformers' own loop (beam search the model's generation config asks for, say) appends
    the reason to ``declined``; one it runs appends its prompt's length to ``starts``."""

    def graphwrap_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        why = _mode_unsupported(model, generation_config)
        if why is not None:  # generate() prepared a request its own loop serves
            if declined is not None:
                declined.append(why)
            plain_instead(model, model_kwargs)
            from transformers.generation.utils import GENERATION_MODES_MAPPING

            method = getattr(type(model), GENERATION_MODES_MAPPING[generation_config.get_generation_mode()])
            return method(model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                          generation_config=generation_config, **model_kwargs)
        if own_cache is not None:
            own_cache(model, input_ids, model_kwargs)
        if starts is not None:
            starts.append(input_ids.shape[1])
        return _loop(model, step, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)

    return graphwrap_decode


def _loop(model, step, input_ids, logits_processor, stopping_criteria, gen, model_kwargs):
    inputs = _StepInputs(model, model_kwargs)
    try:
        return _steps(model, step, input_ids, logits_processor, stopping_criteria, gen, inputs)
    finally:
        inputs.close()


def _steps(model, step, input_ids, logits_processor, stopping_criteria, gen, inputs):
    device = input_ids.device
    prompt, rows = input_ids.shape[1], input_ids.shape[0]
    pad = getattr(gen, "_pad_token_tensor", None)
    if pad is None and gen.pad_token_id is not None:
        pad = torch.tensor(gen.pad_token_id, device=device)
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    if has_eos and pad is None:
        raise ValueError("an end-of-sequence criterion needs a pad token for the finished rows: set pad_token_id")
    max_length = stopping_criteria.max_length
    # The length is known on the host; criteria besides it decide per row on the GPU, and their
    # verdicts are read late.
    criteria = [c for c in stopping_criteria if type(c).__name__ != "MaxLengthCriteria"]
    finished = _Finished(device) if criteria else None
    rng = _Rng(device) if criteria and gen.do_sample else None
    unfinished = torch.ones(rows, dtype=torch.bool, device=device)
    process = processing(logits_processor)

    def last(logits):  # the new position's logits, the loop's own (a step's may be a graph's view)
        return logits[:, -1].to(copy=True, dtype=torch.float32, device=device)

    logits = last(inputs.prefill(input_ids, gen))
    tokens = None
    while True:
        if tokens is not None:
            logits = last(inputs.step(step, input_ids, tokens))
        scores = process(input_ids, logits)
        if gen.do_sample:
            if rng is not None:
                rng.save()
            tokens = torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            tokens = torch.argmax(scores, dim=-1)
        if has_eos:  # finished rows are padded
            tokens = torch.where(unfinished, tokens, cast(torch.Tensor, pad))  # checked above
        input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
        if max_length is not None and input_ids.shape[1] >= max_length:
            break
        if finished is not None:
            done = criteria[0](input_ids, None)
            for c in criteria[1:]:
                done = done | c(input_ids, None)
            unfinished = unfinished & ~done
            if finished.add(unfinished):
                break
        elif max_length is None:
            raise GraphwrapError("generate gave the decode loop no stopping criteria: pass max_new_tokens")
    if finished is not None:
        end = finished.first()
        if end is not None:  # steps queued after every row had finished: dropped
            input_ids = input_ids[:, :prompt + end + 1]
            if rng is not None:
                rng.rewind(end + 1)
    return input_ids


def takes_cache(module, name: str) -> bool:
    """Whether ``generate`` gives this model a transformers cache under ``name``: its forward
    takes one, and transformers does not keep it apart (a model with a cache of its own)."""
    supports = getattr(module, "_supports_default_dynamic_cache", None)
    if callable(supports) and not supports():
        return False
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or "past_key_values" in params


def plain_instead(model, model_kwargs: dict) -> None:
    """Where transformers' own loop takes a request graphwrap's loop was to run: a plain static
    cache of the same length in place of one with ring layers (its loop builds its own masks)."""
    for name in ("cache", "past_key_values"):
        cache = model_kwargs.get(name)
        if cache is not None and any(is_ring(layer) for layer in getattr(cache, "layers", None) or []):
            from transformers import StaticCache

            length = max(layer.max_cache_len for layer in cache.layers)
            model_kwargs[name] = StaticCache(config=model.config, max_cache_len=length)


def text_config(module):
    config = module.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


# ------------------------------------------------------------------ gm.generate

class Step:
    """A decode step through the engine: ``step(**inputs)`` as transformers' loop hands each
    step over, and ``step.logits(inputs)`` from graphwrap's loop where the inputs are kept from
    step to step (:class:`~.repeat.Repeat`); a mixture of experts' graph-safe implementation
    around both. ``handed`` counts the steps."""

    # The inputs a kept step replaces: new tokens, and positions one further.
    REPLACED = ("input_ids", "decoder_input_ids", "position_ids")

    def __init__(self, engine, experts):
        self.engine, self.experts = engine, experts
        self.repeat = Repeat(engine, self.REPLACED, "logits")
        self.handed = 0

    def __call__(self, **kw):
        self.handed += 1
        with self.experts:
            return self.engine.call((), kw)

    def logits(self, kw: dict):
        self.handed += 1
        with self.experts:
            return self.repeat(kw)


def generate(engine, held: dict, module, args, kwargs, not_shared: Optional[str] = None, calls: int = 1,
             starts: Optional[List[int]] = None):
    """``gm.generate``: ``held`` is the GraphedModule's ``__dict__``, which keeps its static caches
    (``_gw_caches``) and the reasons already logged (``_gw_loop_notes``). How each call's steps
    were run is counted in ``stats()["generate"]`` (``calls``: the calls this one runs, joined);
    ``not_shared``, why the shared decode batch did not take the call, is said with a reason of
    the cache's own. Each pass of graphwrap's loop appends its prompt's length to ``starts``."""
    if "_gw_experts" not in held:  # a mixture of experts' steps run a graph-safe implementation
        held["_gw_experts"] = batched_experts(module)
    step = Step(engine, held["_gw_experts"])
    name = cache_keyword(module)
    check_room(args, kwargs)  # a cache the caller passes (graphwrap sizes its own)
    why = unsupported(module) or request_unsupported(kwargs)
    if why is None:
        kwargs = default_static(module, kwargs)
    # Ring layers for sliding windows only where graphwrap's loop runs the steps (window.py).
    kwargs = static_cache(held, module, args, kwargs, name, rings=why is None)
    own = None
    if seq2seq.is_seq2seq(module) and kwargs.get("cache_implementation") == "static" and given_cache(kwargs) is None:
        def own(model, input_ids, model_kwargs):  # the encoder's length is known once generate has run it
            seq2seq.own_cache(held, model, input_ids, model_kwargs, engine.max_keys)
    elif why is None and not any(given_cache(kwargs) is c for c in held.get("_gw_caches", {}).values()):
        why = "the cache is not graphwrap's own (it comes with cache_implementation=\"static\" and no cache given)"
        if not_shared is not None:
            why = f"{not_shared}, and {why}"
    declined: List[str] = []
    if why is None:
        kwargs = dict(kwargs, custom_generate=make_decode_loop(step, own, declined, starts))
    elif why not in held.setdefault("_gw_loop_notes", set()):
        held["_gw_loop_notes"].add(why)
        logger.info("generate runs transformers' own loop, each step handed to graphwrap (%s)", why)
    d = module.__dict__
    before = {k: d[k] for k in ("get_compiled_call", "_valid_auto_compile_criteria") if k in d}
    d["get_compiled_call"] = lambda *_a, **_k: step
    # Every step with a cache goes to graphwrap (a growing one runs eagerly there, with the
    # reason); without a cache (use_cache=False) the model runs as generate runs it.
    d["_valid_auto_compile_criteria"] = lambda model_kwargs, *_a, **_k: given_cache(model_kwargs) is not None
    try:
        out = module.generate(*args, **kwargs)
    finally:
        for k in ("get_compiled_call", "_valid_auto_compile_criteria"):
            d.pop(k, None)
        d.update(before)
    _count(engine, held, why or (declined[0] if declined else None), step.handed, _new_tokens(out, args, kwargs), kwargs,
           calls)
    return out


def _new_tokens(out, args, kwargs) -> Optional[int]:
    ids = kwargs.get("input_ids", args[0] if args else None)
    seqs = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
    if not isinstance(ids, torch.Tensor) or not isinstance(seqs, torch.Tensor) or ids.dim() != 2 or seqs.dim() != 2:
        return None
    return seqs.shape[1] - ids.shape[1] if seqs.shape[0] >= ids.shape[0] else None


def _count(engine, held: dict, why: Optional[str], handed: int, new: Optional[int], kwargs, calls: int = 1):
    """Count how a ``generate`` call's steps were run; a call whose decode steps never reached
    graphwrap says why (transformers ran them itself: beam search calls the model directly, and
    a release that moves the hooks graphwrap uses would show here first)."""
    if why is None:
        how = "graphwrap's decode loop"
    elif handed or not new or new <= 1 or kwargs.get("use_cache") is False:
        how = f"transformers' loop, steps handed to graphwrap ({why})"
    else:
        how = f"transformers' loop, no step reached graphwrap: it called the model itself ({why})"
        if how not in held.setdefault("_gw_loop_notes", set()):
            held["_gw_loop_notes"].add(how)
            logger.warning("generate ran %d new tokens in %s", new, how)
    with engine.lock:
        engine.generates[how] = engine.generates.get(how, 0) + calls


def default_static(module, kwargs) -> dict:
    """An encoder-decoder's call that asks for no cache (none passed, no ``cache_implementation``
    in the call or the model's generation config) gets ``cache_implementation="static"``: a cache
    of graphwrap's own then serves it (:func:`seq2seq.own_cache`, at most ``max_keys`` of them),
    and its steps replay, with the tokens of ``generate``'s own cache (tested equal for each
    family). Decoder-only calls that reach this loop keep what they asked for: each size of a
    static cache would be kept."""
    if not seq2seq.is_seq2seq(module) or not getattr(module, "_can_compile_fullgraph", False):
        return kwargs
    gen = getattr(module, "generation_config", None)
    if ("cache_implementation" in kwargs or getattr(gen, "cache_implementation", None) is not None
            or given_cache(kwargs) is not None or kwargs.get("use_cache", getattr(gen, "use_cache", True)) is False
            or kwargs.get("num_beams", getattr(gen, "num_beams", 1)) not in (None, 1)):
        return kwargs
    return dict(kwargs, cache_implementation="static")


def static_cache(held: dict, module, args, kwargs, name: str = "past_key_values", rings: bool = False) -> dict:
    """With ``cache_implementation="static"`` and no cache given: one static cache of this
    GraphedModule's own per batch size, device and the model's dtype, sized to a multiple of 64
    positions and reset before each ``generate``, so every later ``generate`` of that batch
    (any prompt length that fits) replays the graphs the first one captured. With ``rings``,
    its sliding-window layers are rings (:mod:`.window`) where the model allows them."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if (kwargs.get("cache_implementation") != "static" or given_cache(kwargs) is not None
            or kwargs.get("use_cache") is False
            or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or not isinstance(kwargs.get("max_new_tokens"), int)
            or kwargs.get("num_beams", 1) != 1 or kwargs.get("num_return_sequences", 1) != 1):
        return kwargs
    try:
        from transformers import StaticCache
    except ImportError:
        return kwargs
    if not takes_cache(module, name):
        return kwargs  # a model without a cache of transformers' kind: generate does as it does
    if seq2seq.is_seq2seq(module):
        # Its decoder needs a cache of two parts (self-attention, and cross-attention over the
        # encoder's output, whose length is known once generate has run the encoder): the
        # decode loop puts graphwrap's own in place of the one generate makes (seq2seq.py).
        return kwargs
    need = ids.shape[1] + kwargs["max_new_tokens"]
    size = -(-need // 64) * 64
    caches = held.setdefault("_gw_caches", {})
    rings = rings and ring_unsupported(module) is None
    key = (ids.shape[0], size, ids.device, getattr(module, "dtype", None), rings)
    cache = caches.get(key)
    if cache is None:
        for old in [k for k in caches if (k[0], k[2]) == (key[0], key[2]) and k[3] != key[3]]:
            del caches[old]  # the model's dtype changed: a cache of the old one is no use
        cache = caches[key] = StaticCache(config=module.config, max_cache_len=size)
        if rings:
            use_rings(cache, text_config(module), size)
    else:
        cache.reset()
    kwargs = dict(kwargs, **{name: cache})
    kwargs.pop("cache_implementation")
    return kwargs
