"""The model of ``python -m graphwrap serve``'s arguments loaded and wrapped, and its decode batch
made, in the process that calls (the server's, or its engine process)."""

import argparse
import logging

logger = logging.getLogger("graphwrap.serve")


def load_here(a: argparse.Namespace):
    """The model loaded, wrapped and its decode batch made in this process: a :class:`~.app.Served`
    over a :class:`~.local.Local`."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ...decoding.callers.front import MAX_LEN, model_positions
    from ...module import GraphedModule
    from ...quantized import quantize
    from .app import MAX_NEW_DEFAULT, Served
    from .local import Local

    device = device_of(a)
    dtype = getattr(torch, a.dtype) if a.dtype != "auto" else ("auto" if device.type == "cuda" else torch.float32)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(a.model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, local_files_only=True).to(device).eval()
    logger.info("loaded %s onto %s in %.1f s", type(model).__name__, device, time.perf_counter() - t0)
    if getattr(a, "quantization", None):
        quantize(model, a.quantization)
    decode = {k: v for k, v in (("rows", a.rows), ("max_len", a.max_len), ("max_queue", a.max_queue),
                                ("cache_memory", a.cache_memory), ("prefill_budget", getattr(a, "prefill_budget", None)),
                                ("prefill_whole", getattr(a, "prefill_whole", None)),
                                ("prefill_beside", getattr(a, "prefill_beside", None)),
                                ("kv_cache_dtype", getattr(a, "kv_cache_dtype", None)))
              if v is not None}
    if getattr(a, "prefix_caching", None) is not None:
        decode["prefix_caching"] = a.prefix_caching
    gm = GraphedModule(model, decode=decode)
    context = min([x for x in (a.max_len, model_positions(model.config)) if x] or [MAX_LEN])
    # The batch is made now (its cache, its probe of the model), not on the first request; with
    # --capture first (or ahead), the graphs of the shapes a first burst meets (or of every
    # shape its buckets make) are captured now too.
    if a.capture in ("first", "ahead") and _captured_ahead(gm, "first" if a.capture == "first" else "every"):
        pass
    else:
        first = tok.bos_token_id if tok.bos_token_id is not None else (tok.eos_token_id or 0)
        gm.generate(torch.tensor([[first]]), max_new_tokens=1, do_sample=False, pad_token_id=first)
    d = gm.stats().get("decode")
    if d is None or "off" in d:
        logger.warning("the shared decode batch does not serve this model: requests take turns on it, one at a time")
    return Served(Local(gm, tok), tok, a.served_model_name or a.model, context, a.max_tokens_default or MAX_NEW_DEFAULT)


def device_of(a: argparse.Namespace):
    """The device ``--device`` names (default: a GPU where there is one, else the CPU).
    GraphwrapError for a GPU this process does not see."""
    import torch

    from ...errors import GraphwrapError

    cuda = torch.cuda.is_available()
    device = torch.device(a.device or ("cuda" if cuda else "cpu"))
    count = torch.cuda.device_count() if cuda else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        visible = getattr(a, "cuda_visible", None)  # (--data-parallel: engine i sees the i-th GPU alone)
        more = f" (engine {a.engine_index} of --data-parallel sees GPU {visible} alone)" if visible is not None else ""
        raise GraphwrapError(f"the device {device} is not here: this process sees {count} CUDA devices{more}")
    return device


def tokenizer_of(a: argparse.Namespace):
    """The model's tokenizer, loaded in this process (an HTTP process holds no model)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(a.model, local_files_only=True)


def over(a: argparse.Namespace, remote, tok=None):
    """The :class:`~.app.Served` of these arguments over an engine process's ``remote`` (this
    server's own, or, in another HTTP process, the one the server started), with ``tok`` or the
    model's tokenizer loaded here."""
    from .app import MAX_NEW_DEFAULT, Served

    tok = tok if tok is not None else tokenizer_of(a)
    return limits(a, Served(remote, tok, a.served_model_name or a.model, remote.context,
                            a.max_tokens_default or MAX_NEW_DEFAULT))


def limits(a: argparse.Namespace, served):
    """``served`` with the key, the limits and the tool-call parser these arguments ask for."""
    from .tools import parser_for

    served.api_key = getattr(a, "api_key", None)
    served.key_everywhere = bool(getattr(a, "api_key_everywhere", False))
    served.max_body = int(getattr(a, "max_body_mb", 16.0) * (1 << 20))
    served.max_prompt_chars = getattr(a, "max_prompt_chars", None)
    served.tool_parser = parser_for(served.tokenizer, getattr(a, "tool_call_parser", "auto"))
    return served


def _captured_ahead(gm, shapes: str) -> bool:
    """``gm.capture_generate(shapes=shapes)`` with a log line; False where the batch does not
    serve the model."""
    import time

    from ...errors import GraphwrapError

    t0 = time.perf_counter()
    try:
        gm.capture_generate(shapes=shapes)
    except GraphwrapError:
        return False
    d = gm.stats()["decode"]
    logger.info("captured the graphs of %d step and prompt shapes in %.1f s%s", len(d["shapes"]),
                time.perf_counter() - t0, "; the others are captured as requests need them" if shapes == "first" else "")
    return True


def freeze_startup():
    """What start-up made (torch, transformers, the model, the graphs) out of the garbage
    collector's sight for good: a full collection walks only what serving makes. Otherwise each
    one walks every object start-up made while every thread waits, the decode thread too."""
    import gc

    gc.collect()
    gc.freeze()
