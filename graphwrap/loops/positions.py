"""A ``generate`` call that would run a model past its table of positions, refused before any
forward.

Models with learned or fixed position embeddings (GPT-2's ``wpe``; BART's, OPT's, Marian's and
Whisper's ``embed_positions``) look each position up in a table of a fixed number of rows. A
call whose prompt and new tokens reach past it indexes past the table: on a CPU an IndexError
from inside the model, on a GPU a device-side assert that ends the process's CUDA context for
every caller. :func:`check_positions` raises a :class:`~graphwrap.GraphwrapError` first, naming
the table and what the call needs. Models whose positions are computed (rotary embeddings,
ALiBi, T5's relative buckets) have no such table and are not checked.
"""

import weakref
from typing import List, Optional, Tuple

import torch
from torch import nn

from ..errors import GraphwrapError

# The names transformers' models give a table of positions (the last part of a module's name).
NAMES = ("wpe", "embed_positions", "position_embeddings")

_TABLES: "weakref.WeakKeyDictionary[nn.Module, List[Tuple[str, int]]]" = weakref.WeakKeyDictionary()


def position_tables(module: nn.Module) -> List[Tuple[str, int]]:
    """``(name, positions)`` of each table of positions in ``module``: an ``nn.Embedding`` named
    as in :data:`NAMES`, its rows less the offset the model adds to each position (BART's and
    OPT's 2). Found once per module."""
    found = _TABLES.get(module)
    if found is None:
        found = []
        for name, m in module.named_modules():
            if isinstance(m, nn.Embedding) and name.rsplit(".", 1)[-1] in NAMES:
                offset = getattr(m, "offset", 0)
                found.append((name, m.num_embeddings - (offset if isinstance(offset, int) else 0)))
        _TABLES[module] = found
    return found


def _width(x) -> Optional[int]:
    return x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() >= 1 and not x.is_floating_point() else None


def _total(module, kwargs, width: int) -> int:
    """How many tokens the call's sequences reach (``width`` of them given): ``generate``'s own
    reading of ``max_new_tokens`` over ``max_length``, the call's over its model's."""
    gen = kwargs.get("generation_config") or getattr(module, "generation_config", None)
    for source in (kwargs, vars(gen) if gen is not None else {}):
        if source.get("max_new_tokens") is not None:
            return width + int(source["max_new_tokens"])
        if source is kwargs and source.get("max_length") is not None:
            return int(source["max_length"])
    return int(getattr(gen, "max_length", None) or 20)


def _lead(kwargs, width: int) -> int:
    """Positions a decoder-only model leaves to the left padding of the call's widest-padded
    row (its positions count from each row's first token: ``attention_mask``'s running sum)."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[-1] != width or not mask.numel():
        return 0
    return width - int(mask.sum(-1).max())


def check_positions(module, args, kwargs):
    """A GraphwrapError where the call would run ``module`` past a table of positions: the
    decoder's over its prompt and new tokens (the last token is made, never fed back, so a
    table of ``n`` rows serves sequences of ``n + 1``), an encoder's over its input ids."""
    tables = position_tables(module)
    if not tables:
        return
    encoder_decoder = bool(getattr(getattr(module, "config", None), "is_encoder_decoder", False))
    ids = _width(kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None)))
    run: Optional[int]
    if encoder_decoder:
        given = _width(kwargs.get("decoder_input_ids"))
        run = _total(module, kwargs, given or 1) - 1
    else:
        run = _total(module, kwargs, ids) - 1 - _lead(kwargs, ids) if ids is not None else None
    for name, rows in tables:
        if "encoder" in name.split("."):
            if encoder_decoder and ids is not None and ids > rows:
                raise GraphwrapError(f"input_ids of {ids} tokens are past the {rows} positions of the model's "
                                     f"encoder ({name}): pass at most {rows}")
        elif run is not None and run > rows:
            raise GraphwrapError(f"this call runs the model over {run} positions (its prompt and new tokens, less "
                                 f"the last one made), past the {rows} of its table of positions ({name}): pass "
                                 f"fewer tokens or a smaller max_new_tokens")
