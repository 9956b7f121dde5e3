"""``gm.generate``'s way into the shared decode batch, and out of it where the batch cannot serve.

One :class:`~.server.DecodeServer` per GraphedModule, made on the first ``generate`` call it can
serve (after the probe, :mod:`.probe`, has shown that the cache of rows gives the model's own
logits), with its own engine over the decode step (:class:`~.step.DecodeStep`) sharing the
GraphedModule's options. Calls it cannot serve go to the one-call loop
(:mod:`graphwrap.loops.decode`) and take their turn, with the reason logged once and counted in
``stats()["generate"]``.
"""

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from typing import Optional, Tuple

import torch

from ..core.engine import Engine
from ..errors import GraphwrapError
from ..loops import decode
from ..process import generate_lock
from .scheduler import buckets_upto
from .settings import CallPlan, plan_call

logger = logging.getLogger("graphwrap")
SHARED = "graphwrap's shared decode batch"
ROWS, MAX_LEN = 64, 2048  # defaults: sequences decoded at once, and positions each may hold
_MAKING = threading.Lock()


def decode_options(given, config) -> Optional[dict]:
    """``GraphedModule(decode=...)`` filled in: None where the shared batch is off."""
    if given is False:
        return None
    d = dict(given) if isinstance(given, dict) else {}
    positions = next((getattr(config, a) for a in ("max_position_embeddings", "n_positions", "max_sequence_length")
                      if isinstance(getattr(config, a, None), int)), None)
    d.setdefault("rows", ROWS)
    d.setdefault("max_len", min(positions, MAX_LEN) if positions else MAX_LEN)
    d.setdefault("max_queue", 4096)
    return d


def server_of(held: dict, module) -> Tuple[object, Optional[str]]:
    """This GraphedModule's decode server, made if need be, or why there is none."""
    server = held.get("_gw_decode")
    if server is not None and server.broken is None and not server.closed:
        return server, None
    why = held.get("_gw_decode_why")
    if why is not None:
        return None, why
    with _MAKING:
        server = held.get("_gw_decode")
        if server is not None and server.broken is None and not server.closed:
            return server, None
        # Outside inference mode, where the caller is in it: the rows are written in place by
        # the decode thread, which inference tensors forbid.
        with torch.inference_mode(False):
            server, why = _make(held, module)
        if why is not None:
            held["_gw_decode_why"] = why
            logger.info("graphwrap: generate calls take turns on the model, one at a time (%s)", why)
        else:
            held["_gw_decode"] = server
        return server, why


def _make(held: dict, module):
    opts = held["_gw_options"]
    cfg = decode_options(opts.decode, getattr(module, "config", None))
    if cfg is None:
        return None, "decode=False"
    why = decode.unsupported(module)
    if why is not None:
        return None, why
    if getattr(module.config, "is_encoder_decoder", False):
        return None, "an encoder-decoder model (the shared batch serves decoder-only models)"
    from .probe import probe
    from .server import DecodeServer
    from .step import DecodeStep, PrefillStep

    device = next(module.parameters()).device
    why = probe(module, device)
    if why is not None:
        return None, why
    rows = cfg["rows"]
    spans = len(buckets_upto(cfg["max_len"], (64, 128, 256)))
    step_opts = dataclasses.replace(opts, outputs="view", state="rows", buckets=None, max_batch_size=rows,
                                    seq_dim=None, seq_buckets=None, max_tokens=None, pad_values=0, batch_dim=0,
                                    eager_if_faster=False, decode=False,
                                    max_keys=max(opts.max_keys, 2 * spans * len(buckets_upto(rows, (1, 2, 4, 8, 16)))))
    return DecodeServer(module, Engine(DecodeStep(module), step_opts), Engine(PrefillStep(module), step_opts), rows,
                        cfg["max_len"], cfg["max_queue"]), None


def plan(held: dict, module, args, kwargs):
    """``(server, plan)`` where the shared batch serves this call, else ``(None, why)``."""
    server, why = server_of(held, module)
    if server is None:
        return None, why
    p = plan_call(module, args, kwargs)
    if not isinstance(p, CallPlan):
        return None, p
    return server, p


def count(engine, how: str):
    with engine.lock:
        engine.generates[how] = engine.generates.get(how, 0) + 1


def note(held: dict, why: str):
    notes = held.setdefault("_gw_loop_notes", set())
    if why not in notes:
        notes.add(why)
        logger.info("graphwrap: this generate call takes its turn in the one-call loop (%s)", why)


def output(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return result.to(like.device)


def close(held: dict, cancel: bool = False, timeout: Optional[float] = None) -> bool:
    server = held.pop("_gw_decode", None)
    held.pop("_gw_decode_why", None)
    if server is None:
        return True
    done = server.close(cancel=cancel, timeout=timeout)
    server.engine.reset()
    server.prefill_engine.reset()
    return done


# ------------------------------------------------------------------ GraphedModule's methods

def generate(gm, args, kwargs):
    module = gm.module
    if not callable(getattr(module, "generate", None)):
        raise GraphwrapError(f"{type(module).__name__} has no generate(): it is not a Hugging Face generation model")
    server, p = plan(gm.__dict__, module, args, kwargs)
    if server is None:
        return alone(gm, p, args, kwargs)
    fut = server.submit(p)
    try:
        out = fut.result()
    except BaseException:
        fut.cancel()
        raise
    count(gm.engine, SHARED)
    return output(out, p.input_ids)


def alone(gm, why: str, args, kwargs):
    """A call the shared batch does not serve: the one-call loop, one call at a time per model."""
    module = gm.module
    note(gm.__dict__, why)
    # Outside torch.inference_mode, where the caller is in it: the static cache is allocated
    # by the prompt's forward, and inference tensors could not be written by a capture.
    with generate_lock(module), torch.inference_mode(False):
        return decode.generate(gm.engine, gm.__dict__, module, args, kwargs)


def submit(gm, args, kwargs) -> concurrent.futures.Future:
    server, p = plan(gm.__dict__, gm.module, args, kwargs)
    out: concurrent.futures.Future = concurrent.futures.Future()
    if server is None:
        try:
            out.set_result(alone(gm, p, args, kwargs))
        except Exception as e:  # noqa: BLE001 - handed to the caller through the future
            out.set_exception(e)
        return out
    fut = server.submit(p)

    def done(f):
        if f.cancelled():
            out.cancel()
        elif f.exception() is not None:
            out.set_exception(f.exception())
        else:
            count(gm.engine, SHARED)
            out.set_result(output(f.result(), p.input_ids))

    fut.add_done_callback(done)
    out.add_done_callback(lambda o: fut.cancel() if o.cancelled() else None)
    return out


async def agenerate(gm, args, kwargs):
    from .server import QueueFull

    server, p = plan(gm.__dict__, gm.module, args, kwargs)
    loop = asyncio.get_running_loop()
    if server is None:
        return await loop.run_in_executor(None, lambda: alone(gm, p, args, kwargs))
    try:
        fut = server.submit(p, block=False)
    except QueueFull:
        fut = await loop.run_in_executor(None, server.submit, p)
    out = await asyncio.wrap_future(fut)
    count(gm.engine, SHARED)
    return output(out, p.input_ids)
