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
import time
import weakref
from typing import Optional, Tuple, cast

import torch

from ...capture.cuda import on_device
from ...core.engine import Engine
from ...errors import GraphwrapError
from ...loops import decode
from ...loops.positions import check_positions
from ..cache import fp8
from ..cache.pool import CACHE_MEMORY, MIN_ROWS
from ..engine import collector
from ..engine.scheduler import buckets_upto
from ..engine.step import model_positions
from ..engine.weights import note_values
from ..kernels.attention import without_cudnn
from . import turns
from .grammar import GrammarError
from .settings import PENALTY_KWARGS, CallPlan, plan_call

logger = logging.getLogger("graphwrap")
SHARED = "graphwrap's shared decode batch"
MAX_LEN = 2048  # positions a sequence may hold where the model does not say
_MAKING = threading.Lock()


def decode_options(given, config) -> Optional[dict]:
    """``GraphedModule(decode=...)`` filled in: None where the shared batch is off. ``max_len``
    is at most the model's positions (a row past them would index past its position table:
    on a GPU, a device-side assert that ends the process's CUDA context)."""
    if given is False:
        return None
    d = dict(given) if isinstance(given, dict) else {}
    positions = model_positions(config)
    d.setdefault("rows", None)  # (None: from the pool's memory, pool.rows_for)
    d.setdefault("max_len", positions or MAX_LEN)
    if positions and d["max_len"] > positions:
        logger.warning("decode max_len=%d is above the model's %d positions; the decode cache holds %d",
                       d["max_len"], positions, positions)
        d["max_len"] = positions
    d.setdefault("max_queue", 4096)
    d["positions"] = positions
    return d


def _usable(server) -> bool:
    return server is not None and server.broken is None and not server.closed


def _current(server) -> bool:
    """A batch that serves on: not closed, not broken, its model as it was made with."""
    return _usable(server) and not server.stale()


def server_of(held: dict, module) -> Tuple[object, Optional[str]]:
    """This GraphedModule's decode server, made if need be, or why there is none. One batch at a
    time: a batch that was closed and has not finished yet is waited for before a new one is
    made (two would hold two caches), and a batch whose model changed (``model.half()``,
    ``model.to(...)``) is closed and made again."""
    server = held.get("_gw_decode")
    if _current(server):
        return server, None
    why = held.get("_gw_decode_why")
    if why is not None:
        return None, why
    with _MAKING:
        server = held.get("_gw_decode")
        if _current(server):
            return server, None
        if _usable(server):  # its model changed
            logger.warning("the model's weights changed (dtype, device or storage; with an FP8 cache, values) "
                           "since its decode batch was made; the batch finishes what it holds and is made again")
            close(held)
        old = held.pop("_gw_decode_closing", None)
        if old is not None and old.thread is not None:
            old.thread.join()
        # Outside inference mode, where the caller is in it: the rows are written in place by
        # the decode thread, which inference tensors forbid.
        t0 = time.perf_counter()
        with torch.inference_mode(False):
            try:
                with on_device(_device(module)):  # (its probe and buffers: the model's GPU)
                    server, why = _make(held, module)
            except Exception as e:  # noqa: BLE001 - out of memory, say: the one-call loop serves, once decided
                server, why = None, f"the shared decode batch could not be made ({type(e).__name__}: {_first_line(e)})"
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # what the failed allocation left cached, back to the one-call loop
        if why is not None:
            held["_gw_decode_why"] = why
            logger.info("generate calls take turns on the model, one at a time (%s)", why)
            asked = held["_gw_options"].decode
            if isinstance(asked, dict) and fp8.wanted(asked.get("kv_cache_dtype")):
                logger.warning("decode={'kv_cache_dtype': 'fp8'} is the shared batch's cache, and there is none: "
                               "each call decodes with the model's own cache, in its dtype")
        else:
            held["_gw_decode"] = server
            logger.info("the shared decode batch made in %.1f s (its probe of the model, the cache, the engines)",
                        time.perf_counter() - t0)
        return server, why


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


def _make(held: dict, module):
    opts = held["_gw_options"]
    cfg = decode_options(opts.decode, getattr(module, "config", None))
    if cfg is None:
        return None, "decode=False"
    why = decode.unsupported(module) or (getattr(module.config, "is_encoder_decoder", False) and
                                         "an encoder-decoder model (the shared batch serves decoder-only models)")
    if why:
        return None, why
    from ...quantized import exact_products
    from ..cache.pool import rows_possible
    from ..engine.probe import probe, probe_mixed
    from ..engine.server import DecodeServer, reads_in_place
    from ..engine.step import DecodeStep, MixedStep, PieceStep, PrefillStep

    device = next(module.parameters()).device
    kv = cfg.get("kv_cache_dtype")
    in_place = reads_in_place(module, device, kv)
    # (its eager forwards meet new shapes: see attention.py; FP8 layers: see exact_products)
    with without_cudnn(device), exact_products():
        whole_rows = rows_possible(cfg.get("paged"), device.type == "cuda", in_place) and not fp8.wanted(kv)
        why = probe(module, device, whole_rows, in_place)  # (an FP8 cache is paged)
        mixed_why = probe_mixed(module, device) if why is None and in_place else "the pool is not read in place"
    if why is not None:
        return None, why
    if in_place and mixed_why is not None:
        logger.info("a long prompt's pieces run apart from the decode steps of %s: %s", type(module).__name__, mixed_why)
    rows = cfg["rows"] or _default_rows(module, device, cfg.get("cache_memory", CACHE_MEMORY), kv)
    # Each shape's graph is a key of its own (over its own twin of the cache, see captures.py):
    # the reference run warms it up, and one warm-up more does (cuBLAS, Triton) where nothing is
    # compiled; a compiled forward keeps the caller's warm-ups.
    warmups = opts.warmup_iters if opts.compile is not None else min(opts.warmup_iters, 1)
    step_opts = dataclasses.replace(opts, outputs="view", state="rows", buckets=None, max_batch_size=rows,
                                    warmup_iters=warmups,
                                    seq_dim=None, seq_buckets=None, max_tokens=None, pad_values=0, batch_dim=0,
                                    eager_if_faster=False, decode=False,
                                    max_keys=max(opts.max_keys, _shapes(rows, cfg["max_len"])))
    kinds = {"step": DecodeStep, "prefill": PrefillStep, "piece": PieceStep}
    if mixed_why is None:
        kinds["mixed"] = MixedStep
    # With compile=, plain graphs serve each shape first and compiled ones replace them, captured
    # beside the decode thread (captures.py); where the decode thread captures, compiled from the first.
    plain = step_opts if opts.compile is None else dataclasses.replace(
        step_opts, compile=None, warmup_iters=min(opts.warmup_iters, 1))
    engines = {kind: Engine(cls(module), plain) for kind, cls in kinds.items()}
    compiled = None if opts.compile is None else {kind: Engine(cls(module), step_opts) for kind, cls in kinds.items()}
    # What the GraphedModule has logged once (no CUDA, say) is not logged again by the batch's engines.
    for engine in [*engines.values(), *(compiled or {}).values()]:
        engine.logged = held["_gw_engine"].logged
    server = DecodeServer(module, engines["step"], engines["prefill"], rows, cfg["max_len"], cfg["max_queue"],
                          cfg["positions"], cfg.get("cache_memory", CACHE_MEMORY), cfg.get("paged"), engines["piece"],
                          engines.get("mixed"), compiled, cfg.get("prefix_caching", True), kv)
    server.budget = cfg.get("prefill_budget")  # (None: pieces.BUDGET)
    server.whole_limit = cfg.get("prefill_whole")  # (None: pieces.WHOLE)
    server.beside = cfg.get("prefill_beside")  # (None: schedule.PREFILL_BESIDE)
    collector.clock()  # (the collector's pauses, from the process's first batch on: stats()["decode"])
    if cfg.get("prefix_caching") and server.sched.pool is None:  # (asked for: on by default, it says nothing)
        logger.warning("prefix caching needs the paged cache, and this batch's cache is whole rows (%s): every "
                       "prompt is computed whole", server.cache.why)
    return server, None


def _default_rows(module, device: torch.device, fraction: float, kv_cache_dtype: Optional[str] = None) -> int:
    """Rows a step may hold where the caller did not say: what the pool would hold (pool.rows_for)."""
    from ..cache.pool import rows_for
    from ..engine.server import _free_memory, _token_bytes
    from ..engine.step import cache_layout

    free = _free_memory(device)
    if free is None:
        return rows_for(0, None)
    with without_cudnn(device):
        keys, values = cache_layout(module, device)
    return rows_for(_token_bytes(keys, values, kv_cache_dtype), free, fraction)


def _shapes(rows: int, max_len: int) -> int:
    """Keys an engine of the batch may need: a graph of each step shape (row and span buckets),
    prompt shape (row and width buckets) or piece shape (span buckets), each over a twin of its
    own, twice over."""
    from ..engine.step import CHUNK, Prompts

    prompts = Prompts(rows, min(max_len, CHUNK), rows)
    spans = len(buckets_upto(max_len, (64, 128, 256)))
    steps = len(buckets_upto(rows, (1, 2, 4, 8, 16))) * spans
    return 2 * max(steps, len(prompts.row_buckets) * len(prompts.width_buckets), spans)


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
        logger.info("this generate call takes its turn in the one-call loop (%s)", why)


def output(result: torch.Tensor, plan: CallPlan) -> torch.Tensor:
    return result.to(plan.device)


def stats(held: dict, module) -> dict:
    """What ``gm.stats()`` says of generation beside the engine's: the shared batch (or why there
    is none) and the turns on the model."""
    out: dict = {}
    server = held.get("_gw_decode")
    if server is not None:
        out["decode"] = dict(server.stats(), step=server.engine.stats(), prefill=server.prefill_engine.stats())
        if server.compiled_engines:  # compile=: the engines of the compiled graphs that replace plain ones
            out["decode"]["compiled_engines"] = {k: e.stats() for k, e in server.compiled_engines.items()}
    elif held.get("_gw_decode_why") is not None:
        out["decode"] = {"off": held["_gw_decode_why"]}
    t = turns.turns_of(module, make=False)
    if t is not None:
        out["generate_turns"] = dict(t.counts)
    return out


def _queueing(held: dict) -> "threading.RLock":
    """The lock under which a call takes this GraphedModule's batch and is queued on it, and
    ``close()`` takes the batch away: a call is queued on a batch before it closes (which then
    serves it), or finds the next one. Reentrant: a close from the thread that holds it (a
    callback's, say) goes on, and the call then finds the next batch."""
    lock = held.get("_gw_queueing")
    return lock if lock is not None else held.setdefault("_gw_queueing", threading.RLock())


def close(held: dict, cancel: bool = False, timeout: Optional[float] = None) -> bool:
    with _queueing(held):
        server = held.pop("_gw_decode", None)
        held.pop("_gw_decode_why", None)
        if server is not None:
            server.close(timeout=0)  # (no new call from now on; the cancels, and their callbacks, and the wait below)
    if server is None:
        return True
    done = server.close(cancel=cancel, timeout=timeout)
    if not done:
        held["_gw_decode_closing"] = server  # the next batch waits for it
    server.engine.reset()
    server.prefill_engine.reset()
    for engine in server.compiled_engines.values():
        engine.reset()
    return done


def _close_dropped(held: dict):
    """A GraphedModule was dropped: its batch finishes what it holds (callers may still hold
    futures) and its thread ends, letting go of the cache and the model."""
    server = held.get("_gw_decode")
    if server is not None:
        server.close(timeout=0)


# ------------------------------------------------------------------ GraphedModule's methods

def _queued(gm, args, kwargs, block: bool = True, seed: Optional[int] = None):
    """``(server, plan, call)`` with the call queued on the shared batch, or ``(None, why, None)``.
    The call is planned first (its grammar compiled, say), then taken by the batch under the
    lock that ``close()`` takes: a batch closed meanwhile (``gm.close()`` from another thread)
    is replaced there, and the call goes to the next one."""
    held = gm.__dict__
    server, p = plan(held, gm.module, args, kwargs)
    for _ in range(3):
        if server is not None:
            server, p, call = _take(gm, server, p, seed, block)
            if call is not None:
                return server, p, call
            if server is not None:
                continue
        if getattr(kwargs.get("streamer"), "logprobs", None) is not None:  # (no loop but the batch's gives them)
            raise GraphwrapError(f"log-probabilities come from the shared batch only, which does not serve this "
                                 f"call: {p}")
        if kwargs.get("grammar") is not None:  # (nor applies a grammar)
            raise GrammarError(f"a grammar is applied by the shared batch only, which does not serve this call: {p}")
        if any(kwargs.get(k) for k in PENALTY_KWARGS):  # (nor these penalties)
            raise GraphwrapError(f"presence_penalty and frequency_penalty are applied by the shared batch only, "
                                 f"which does not serve this call: {p}")
        return None, p, None
    raise GraphwrapError("this GraphedModule's decode batch was closed three times while a call was being queued")


def _take(gm, server, p, seed: Optional[int], block: bool):
    """``(server, plan, call)``: the call of ``p`` queued on ``server``, or on the batch that
    replaced it where it closed meanwhile (made here if need be; ``(None, why, None)`` where
    none serves now); the call None where the batch closed before taking it (the caller tries
    again). Where the queue is full, it waits for room outside the lock (``block``), or raises
    QueueFull carrying the call (agenerate waits for room with it)."""
    from .errors import Closed, QueueFull

    held = gm.__dict__
    with _queueing(held):
        if held.get("_gw_decode") is not server:  # closed meanwhile: the next batch
            server, why = server_of(held, gm.module)
            if server is None:
                return None, why, None
        if "_gw_decode_finalizer" not in held:
            held["_gw_decode_finalizer"] = weakref.finalize(gm, _close_dropped, held)
        note_values(server)
        call = server.prepare(p, seed)
        try:
            server.enqueue(call, block=False)
            return server, p, call
        except Closed:  # (closed by its own thread: broken, or the process exiting)
            return server, p, None
        except QueueFull as full:
            if not block:
                full.server, full.call = server, call
                raise
    try:
        server.enqueue(call, block=True)
    except Closed:
        return server, p, None
    return server, p, call


def capture_generate(gm, timeout: Optional[float] = None, shapes: str = "every") -> bool:
    """``gm.capture_generate``: the shared batch made, and the graphs of every shape its buckets
    make captured (``shapes="first"``: those a first burst meets), beside the decode thread,
    which serves meanwhile; whether every capture ended within ``timeout``. GraphwrapError where
    the batch cannot serve this model."""
    from ..engine.captures import every_shape

    if shapes not in ("every", "first"):
        raise GraphwrapError(f'shapes must be "every" or "first", got {shapes!r}')
    held = gm.__dict__
    if not callable(getattr(gm.module, "generate", None)):
        raise GraphwrapError(f"{type(gm.module).__name__} has no generate(): it is not a Hugging Face generation model")
    server, why = server_of(held, gm.module)
    if server is None:
        raise GraphwrapError(f"no shared decode batch for this model: {why}")
    if "_gw_decode_finalizer" not in held:
        held["_gw_decode_finalizer"] = weakref.finalize(gm, _close_dropped, held)
    return every_shape(server, timeout, first=shapes == "first")


def generate(gm, args, kwargs):
    module = gm.module
    if not callable(getattr(module, "generate", None)):
        raise GraphwrapError(f"{type(module).__name__} has no generate(): it is not a Hugging Face generation model")
    server, p, call = _queued(gm, args, kwargs)
    if server is None:
        return alone(gm, p, args, kwargs)
    try:
        out = call.future.result()
    except BaseException:
        call.future.cancel()
        raise
    count(gm.engine, SHARED)
    return output(out, p)


def alone(gm, why: str, args, kwargs):
    """A call the shared batch does not serve: the one-call loop, one call at a time per model.
    A call that fails ends its streamer, as the shared batch does (a consumer waiting on the
    streamer is let go; transformers' ``generate`` leaves it open)."""
    module = gm.module
    held = gm.__dict__
    note(held, why)
    per_call = why != held.get("_gw_decode_why")  # this call's settings, not the model
    cfg = decode_options(held["_gw_options"].decode, getattr(module, "config", None))

    def run(args, kwargs, calls, starts):
        # Outside torch.inference_mode, where the caller is in it: the static cache is allocated
        # by the prompt's forward, and inference tensors could not be written by a capture.
        with torch.inference_mode(False), without_cudnn(_device(module)):
            return decode.generate(gm.engine, held, module, args, kwargs, not_shared=why if per_call else None,
                                   calls=calls, starts=starts)

    # Calls that wait for the turn together run as one batch where they can (turns.py); with
    # decode=False each call runs alone.
    # (an encoder-decoder's output is cut where graphwrap's loop saw its decoder's start)
    joins = cfg is not None and decode.unsupported(module) is None and (
        not getattr(getattr(module, "config", None), "is_encoder_decoder", False)
        or decode.request_unsupported(kwargs) is None)
    try:
        # (before its turn: a bad call fails at once, and is never joined)
        decode.check_ids(module, args, kwargs)
        check_positions(module, args, kwargs)
        me = turns.waiter(module, args, kwargs) if joins else turns.Waiter(args, kwargs)
        most = (cfg["rows"] or MIN_ROWS) if cfg is not None else 1
        return turns.take(cast(turns.Turns, turns.turns_of(module)), me, most, run)
    except BaseException:
        streamer = kwargs.get("streamer")
        if streamer is not None:
            try:
                streamer.end()
            except Exception:  # noqa: BLE001 - the call's own error is the one raised
                pass
        raise


def _device(module) -> Optional[torch.device]:
    p = next(module.parameters(), None)
    return p.device if p is not None else None


def submit(gm, args, kwargs, block: bool = True, seed: Optional[int] = None) -> concurrent.futures.Future:
    """``gm.submit_generate``; ``block=False`` raises QueueFull where the queue is full, and
    ``seed`` seeds the call's sampling noise (else torch's default generator does)."""
    server, p, call = _queued(gm, args, kwargs, block, seed)
    out: concurrent.futures.Future = concurrent.futures.Future()
    if server is None:
        try:
            out.set_result(alone(gm, p, args, kwargs))
        except Exception as e:  # noqa: BLE001 - handed to the caller through the future
            out.set_exception(e)
        return out
    fut, engine = call.future, gm.engine  # (not gm: a future held must not keep the GraphedModule)

    def done(f):  # (on a delivery worker: never the decode thread)
        if f.cancelled():
            out.cancel()
        elif f.exception() is not None:
            out.set_exception(f.exception())
        else:
            count(engine, SHARED)
            out.set_result(output(f.result(), p))

    fut.add_done_callback(done)
    out.add_done_callback(lambda o: fut.cancel() if o.cancelled() else None)
    return out


async def agenerate(gm, args, kwargs):
    from .errors import Closed, QueueFull

    loop = asyncio.get_running_loop()
    try:
        server, p, call = _queued(gm, args, kwargs, block=False)
    except QueueFull as full:
        # Queued once room comes, waiting in a thread: the call (its seeds, its streamer's
        # prompt) is the one already prepared, and a task cancelled meanwhile is never queued.
        call = full.call
        server, p = full.server, call.plan
        try:
            await asyncio.shield(loop.run_in_executor(None, server.enqueue, call, True))
        except Closed:  # the batch was closed while the call waited for room: the next one takes it
            server, p, call = await loop.run_in_executor(None, lambda: _queued(gm, args, kwargs))
        except asyncio.CancelledError:
            call.future.cancel()
            raise
    if server is None:
        return await loop.run_in_executor(None, lambda: alone(gm, p, args, kwargs))
    out = await asyncio.wrap_future(call.future)
    count(gm.engine, SHARED)
    return output(out, p)
