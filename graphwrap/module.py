"""GraphedModule: the nn.Module face of graphwrap's engine.

It behaves as the wrapped module does (attributes, ``state_dict``, ``.to``, ``train``, nesting
in a parent module) and hands every call to the engine (:mod:`graphwrap.core.engine`) through the
direct-call loop (:mod:`graphwrap.loops.calls`).
"""

import concurrent.futures
import logging
import weakref
from typing import Any, Iterable, Iterator, Literal, Optional, Tuple

from torch import nn
from torch.nn.modules import module as _nn_module

from .core.engine import Engine
from .core.reasons import Eager, Kind
from .core.records import release_store
from .decoding.callers import front
from .errors import GraphwrapError
from .options import Buckets, CompileArg, DecodeArg, Dims, Options, PadValues, SeqBuckets, StateArg

logger = logging.getLogger("graphwrap")

# Module-level hook tables of torch.nn (mutated in place, never rebound): a call with any of
# them set goes through nn.Module.__call__, which runs the hooks.
_GLOBAL_HOOKS = tuple(getattr(_nn_module, name) for name in (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
    "_global_backward_hooks", "_global_forward_hooks_always_called") if hasattr(_nn_module, name))
_module_call = nn.Module.__call__


class GraphedModule(nn.Module):
    r"""Wraps a module so that calls replay CUDA graphs captured per batch-size bucket.

    ``gm = GraphedModule(model)`` is called exactly like ``model``. Each call's batch is
    padded up to the smallest bucket that holds it, copied into that bucket's static inputs,
    and served by one graph replay; the outputs are cut back to the real rows.

    Args:
        module: the module to wrap. Its parameters, buffers and submodules are shared, not copied.
        buckets: the batch sizes graphs are captured for, or a policy:

            * ``None`` or ``"default"``: :func:`graphwrap.default_buckets` up to ``max_batch_size``
              (1, 2, 4, 8, steps of 8 to 128, then eighths): at most 12.5% padding above 64 rows.
            * ``"exact"``: one bucket per batch size up to ``max_batch_size``, no padding; a graph
              per distinct size seen. For compute-bound models whose padded rows cost real time.
            * :class:`graphwrap.Adaptive`: at most ``k`` buckets fitted to a histogram of batch
              sizes, given or counted over the first calls (which run eagerly).
            * a list of batch sizes.
        max_batch_size: largest bucket of ``"default"`` and ``"exact"`` (256; 64 with ``seq_dim``). Larger batches
            are split into chunks of at most the largest bucket, each served by a replay, and
            joined; their host inputs are copied on a copy stream of graphwrap's own, so a host
            tensor filled by a ``non_blocking`` copy must be complete before it is passed.
        compile: ``True`` or a dict of ``torch.compile`` options (``mode``, ``options``,
            ``dynamic``, ``fullgraph``) and ``cache``. The forward is compiled by Inductor
            without its CUDA graphs, and each bucket's graph captures the compiled kernels.
            ``dynamic="batch"`` (default): the batch dimension is dynamic, so one compile
            serves every bucket (the default and exact policies then start at bucket 2, and a
            batch of one row runs in it); ``False``: kernels compiled for each bucket's shape;
            ``True``: every dimension dynamic. ``static="auto"`` (default with ``dynamic="batch"``):
            once a bucket has served a few calls, a thread compiles kernels for its own shape,
            captures them and keeps them if they replay faster than the shared ones (hot buckets
            first, each once; ``False``: never). ``cache``: a file that the compile artifacts are
            loaded from before compiling and saved to after :meth:`capture`, so a new process
            compiles in seconds. If compiling fails, or Inductor cannot run here, the plain
            forward is captured instead, with a warning and the reason in ``stats()``.
        max_pool_bytes: memory budget of the graph pool. A bucket is captured only if the
            pool's growth, estimated from the peak memory of a warm-up run, fits in what is left;
            batches of a bucket left out go to the next larger captured bucket (or run eagerly
            if there is none). Call :meth:`capture` first so that the largest buckets are
            captured first. Estimating resets ``torch.cuda``'s peak memory statistics.
        batch_dim: the dimension of the tensor inputs and batched outputs that holds the batch
            (0). An input without it, or with one row where the others have more, is taken as
            not batched (broadcast over the batch; copied in whole). A dict by input name or
            position says it per input, with None for an input that is not batched, e.g.
            ``batch_dim={"pos": None}``; inputs left out keep 0. Calls whose inputs disagree on
            the batch otherwise run eagerly, with the reason in ``stats()``.
        seq_dim: the dimension of the tensor inputs that varies per call with the sequence
            length (None: none does). An int applies to every tensor input that has that
            dimension; a dict by input name or position names them (``{"input_ids": 1,
            "attention_mask": 1}``). Lengths are padded up to a sequence bucket with
            ``pad_values``, outputs that carry the sequence are cut back to the real length,
            and each captured graph is first verified to give the real positions what eager
            gives them at the real length; a model that does not ignore padded positions is
            served at exact lengths instead, and says so in ``stats()`` and the log.
        seq_buckets: the sequence lengths graphs are captured for: ``None``/``"default"``
            (16, 32, 48, 64, 96, 128, 192, 256, 384, 512), ``"exact"`` (every length, no
            padding) or a list. Longer inputs run eagerly, with the reason.
        pad_values: the value padded positions hold, one number for every input or a dict by
            input name (0: suits ``input_ids`` with pad id 0, ``attention_mask`` and
            ``token_type_ids``).
        max_tokens: with ``seq_dim``, the most rows times length of one graph (16384): the
            largest batch bucket at each sequence bucket; larger batches are served in chunks.
        warmup_iters: eager runs on a side stream before each capture.
        outputs: ``"clone"`` returns tensors the caller owns. ``"view"`` returns views of the
            static output buffers, with no copy.
        fallback: ``"eager"`` runs the module eagerly for inputs whose capture failed, logging
            the reason once; ``"raise"`` raises :class:`GraphwrapError` instead.
        verify: after each capture, replay on the warm-up inputs and compare with eager, then
            replay with other padding rows to catch models that mix rows of the batch.
        max_keys: how many input signatures get graphs; calls with further signatures run eagerly
            (with ``seq_dim``, the lengths of one signature are buckets of one key).
        eager_if_faster: when a bucket is captured, time a few calls through its graph and
            eagerly, and serve that bucket eagerly if eager took at most 0.9x the graph's time
            (a model of one or two kernels, say). ``stats()`` shows each bucket's times and
            what serves it.
        state: inputs the forward writes in place (a KV cache passed as tensors): a name or
            position, or a list of them. Their tensors are used where they live, never copied,
            padded or cut; the graphs are keyed on them (another tensor, or one allocated again,
            gets its own graphs) and write them as the module does. A call with state is served
            at its own shapes. transformers' static caches are state without this.
        decode: the shared decode batch of :meth:`generate` (Hugging Face models): ``None`` or
            ``True`` (default) for ``{"rows": 64, "max_len": the model's positions,
            "max_queue": 4096, "cache_memory": 0.7, "paged": None}``, a dict of any of those,
            or ``False`` to give each call the model in turn. ``rows``: sequences decoded at
            once; ``max_len``: positions a sequence may take (prompt and new tokens);
            ``max_queue``: sequences waiting for a row; ``cache_memory``: the share of the GPU
            memory free when the batch is made that its cache may take; ``paged``: the cache's
            layout (None: whole rows where they fit that share, else blocks of a pool that
            sequences take as they are admitted; on a CPU, a pool that grows); ``kv_cache_dtype``:
            ``"auto"`` (the model's dtype) or ``"fp8"`` (E4M3, docs/quantization.md).

    .. warning::
        With ``outputs="view"``, the returned tensors are overwritten by the next call of this
        GraphedModule (from any thread). Clone what you keep.

    .. warning::
        The forward is captured once per bucket. Parameters and buffers replaced, submodules
        replaced, forward hooks added or removed, ``train()``/``eval()`` on any submodule and a
        new default dtype are seen before the next replay (the graphs are captured again).
        Python-side state it reads (plain attributes, a ``.training`` flag assigned directly,
        objects such as a config, random numbers drawn on the host) is frozen at capture: call
        :meth:`reset` after changing it. A forward that writes its own buffers changes them
        once per call, as the module does.

    .. warning::
        Outputs never require grad, on a GPU and on a CPU alike. A call whose inputs require grad
        with grad mode on, or with the module in training mode, runs eagerly with grad.

    .. warning::
        A forward that writes into its inputs (in-place preprocessing, a cache passed in) is
        found at capture, on graphwrap's own copy of the inputs, and runs eagerly on yours.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        buckets: Buckets = None,
        max_batch_size: Optional[int] = None,
        batch_dim: Dims = 0,
        seq_dim: Dims = None,
        seq_buckets: SeqBuckets = None,
        pad_values: PadValues = 0,
        max_tokens: Optional[int] = None,
        warmup_iters: int = 3,
        outputs: Literal["clone", "view"] = "clone",
        fallback: Literal["eager", "raise"] = "eager",
        verify: bool = True,
        max_keys: int = 16,
        compile: CompileArg = None,
        max_pool_bytes: Optional[int] = None,
        eager_if_faster: bool = True,
        state: StateArg = None,
        decode: DecodeArg = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise GraphwrapError(f"GraphedModule wraps an nn.Module, got {type(module).__name__}")
        if isinstance(module, GraphedModule):
            raise GraphwrapError("this module is a GraphedModule already; wrap its .module, or use it as it is")
        opts = Options(buckets, max_batch_size, batch_dim, seq_dim, seq_buckets, pad_values, max_tokens, warmup_iters,
                       outputs, fallback, verify, max_keys, compile, max_pool_bytes, eager_if_faster, state,
                       decode).check()
        super().__init__()
        self._gw_attach(module, opts)

    def _gw_attach(self, module: nn.Module, opts: Options):
        object.__setattr__(self, "_gw_module", module)
        # Share the module's tables, so parameters(), state_dict keys and nesting inside a
        # parent module are exactly the module's own.
        object.__setattr__(self, "_parameters", module._parameters)
        object.__setattr__(self, "_buffers", module._buffers)
        object.__setattr__(self, "_modules", module._modules)
        object.__setattr__(self, "_non_persistent_buffers_set", module._non_persistent_buffers_set)
        self.training = module.training
        engine = Engine(module, opts)
        d = self.__dict__
        d["_gw_engine"] = engine
        d["_gw_options"] = opts
        d["_gw_outputs"] = opts.outputs
        d["_gw_finalizer"] = weakref.finalize(self, release_store, engine.store)

    # ------------------------------------------------------------------ copies and pickles

    def __getstate__(self):
        # Graphs, static buffers, locks and threads stay behind: a copy or a loaded module
        # captures its own on its first calls, as a new GraphedModule would.
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_gw_engine", "_gw_finalizer", "_parameters", "_buffers", "_modules",
                              "_non_persistent_buffers_set", "_gw_caches", "_gw_loop_notes",
                              "_gw_decode", "_gw_decode_why", "_gw_queueing", "_gw_decode_closing",
                              "_gw_decode_finalizer")}
        state["_gw_options"] = self.__dict__["_gw_options"].as_kwargs()
        return state

    def __setstate__(self, state):
        state = dict(state)
        module = state.pop("_gw_module")
        opts = Options(**state.pop("_gw_options"))
        self.__dict__.update(state)
        self._gw_attach(module, opts)

    # ------------------------------------------------------------------ containers

    def __len__(self):
        return len(self.__dict__["_gw_module"])

    def __iter__(self):
        return iter(self.__dict__["_gw_module"])

    def __getitem__(self, idx):
        return self.__dict__["_gw_module"][idx]

    # ------------------------------------------------------------------ the call

    def __call__(self, *args, **kwargs):
        # nn.Module.__call__ reads a dozen hook tables on every call; with none set, it would
        # call forward. Checked here in a few lookups, and the module's own __call__ otherwise.
        d = self.__dict__
        if (d["_forward_pre_hooks"] or d["_forward_hooks"] or d["_backward_pre_hooks"] or d["_backward_hooks"]
                or d.get("_compiled_call_impl") is not None or any(_GLOBAL_HOOKS)):
            return _module_call(self, *args, **kwargs)
        return d["_gw_engine"].call(args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_gw_engine"].call(args, kwargs)

    # ------------------------------------------------------------------ drop-in behaviour

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self.__dict__["_gw_module"]

    @property
    def engine(self) -> Engine:
        """The engine that captures and replays this module's graphs (what the loops drive)."""
        return self.__dict__["_gw_engine"]

    @property
    def buckets(self) -> Tuple[int, ...]:
        """The batch-size buckets, smallest first."""
        return self.engine.grid.batch.buckets

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        d = self.__dict__
        if "_gw_module" not in d:
            raise AttributeError(name)
        return getattr(d["_gw_module"], name)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(dir(self.__dict__["_gw_module"])))

    def extra_repr(self):
        e = self.engine
        return (f"module={type(self.module).__name__}, buckets={list(self.buckets)}, "
                f"outputs={self._gw_outputs!r}, fallback={e.fallback!r}")

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, *args, **kwargs):
        # In-place copies keep the tensors the graphs read, so the next replay sees the new
        # weights; assign=True swaps tensors, which the engine's pointer check catches.
        return self.module.load_state_dict(state_dict, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        return self.module._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        # .to(), .cuda(), .half(), .float() ... all come here: graphs of the old tensors go.
        self.reset()
        self.module._apply(fn, *args, **kwargs)
        return self

    def train(self, mode: bool = True) -> "GraphedModule":
        self.module.train(mode)
        self.training = mode
        return self

    # ------------------------------------------------------------------ public API

    def reset(self) -> None:
        """Drop every graph and static buffer; the next calls capture again. The shared decode
        batch (:meth:`generate`) finishes what it holds and is made again on the next call."""
        self.engine.reset()
        front.close(self.__dict__)

    def capture(self, *args: Any, background: bool = False, **kwargs: Any) -> dict:
        """Capture every bucket for the signature of these inputs now, largest first.

        The inputs serve as samples: buckets smaller than their batch take its first rows,
        larger ones repeat its rows; with ``seq_dim``, every sequence bucket is captured too,
        the sample cut or padded to its length. Progress (bucket, time, pool memory) is logged at
        INFO on the ``graphwrap`` logger. Returns ``stats()`` of this signature. Where graphs
        cannot run (no CUDA, a module on the CPU), it captures nothing, says why in the log and
        returns ``stats()``, so code written for a GPU runs unchanged on a CPU.

        With ``background=True`` it returns at once and the engine's worker thread does the
        work: it captures the plain forward of every bucket, then (with ``compile=``) compiles
        the forward and replaces each bucket's graph with one of the compiled kernels, bucket by
        bucket. Calls are served all the while: eagerly until their bucket's first graph is
        captured, then by it. :meth:`wait` waits for it; ``stats()["compile"]`` says where it
        is. ``background`` is graphwrap's own argument: the module never sees it.
        """
        engine = self.engine
        f = engine.facts(args, kwargs)
        if type(f) is Eager:
            if f.kind is Kind.NO_GRAPHS:
                logger.warning("capture() captured nothing: %s; calls run the module eagerly", f)
                return engine.stats()
            raise GraphwrapError(f"cannot capture: {f}")
        return engine.capture(f, background)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for a ``capture(..., background=True)`` to finish, and for the per-size kernels
        of the buckets that have served calls (``compile=``'s ``static="auto"``); whether both
        are done within ``timeout`` (True if nothing ran)."""
        if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                    or not timeout >= 0):
            raise GraphwrapError(f"wait(timeout=) takes seconds (a number >= 0) or None, got {timeout!r}")
        return self.engine.wait(timeout)

    def stats(self) -> dict:
        """Per signature and bucket: captured, what serves it (graph or eager, with the times
        measured at capture), replays, real and padded rows, capture time, fallbacks.

        Also the eager calls by reason, the calls served eagerly by choice, and the memory the
        graph pool and static inputs hold; under ``"decode"``, the shared decode batch of
        :meth:`generate` (its rows and cache, steps, rows per step, prefills, queue waits, time to
        first token and per output token, and its step's graphs), or why there is none.
        """
        return dict(self.engine.stats(), **front.stats(self.__dict__, self.module))

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate`` (a Hugging Face model), its decode steps replayed by
        graphs: ``gm.generate(**inputs, max_new_tokens=...)`` gives ``model.generate``'s tokens.

        Calls from many threads share one decode batch (continuous batching): each sequence takes
        a row of a KV cache graphwrap owns, its prompt's forward runs (joined with others that
        wait), it joins the next step, and leaves when it ends (an end-of-sequence token,
        ``max_new_tokens``), freeing its row. Each step is one replay over every live row.
        Greedy and sampled decoding (``temperature``, ``top_k``, ``top_p``), ``repetition_penalty``,
        ``min_new_tokens``, ``eos_token_id``, a left-padded batch of prompts and a ``streamer``
        (one prompt) are served per sequence; sampled tokens come from noise seeded by torch's
        default generator at the call, so ``torch.manual_seed`` before a call repeats its tokens
        alone or in any batch (they are not ``model.generate``'s draws). A prompt longer than the
        cache holds raises :class:`GraphwrapError`. Calls the batch cannot serve (beams, custom
        processors, a cache passed in, a model whose attention the rows do not reproduce) run
        the one-call loop, taking turns, with the reason in the log and ``stats()["generate"]``.
        ``grammar=graphwrap.Grammar.json_schema(schema)`` (or ``.json()``, ``.regex()``,
        ``.choice()``, ``.ebnf()``) with ``tokenizer=`` constrains the output to it (needs
        ``xgrammar``; the shared batch alone applies it: a call it cannot serve raises).
        """
        return front.generate(self, args, kwargs)

    def submit_generate(self, *args: Any, **kwargs: Any) -> "concurrent.futures.Future[Any]":
        """:meth:`generate` without waiting: a :class:`concurrent.futures.Future` of its output.
        ``future.cancel()`` ends the call where it stands and frees its rows. A call the shared
        batch does not serve runs now, in this thread, and the future returned is done."""
        return front.submit(self, args, kwargs)

    async def agenerate(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`generate` for asyncio: ``await gm.agenerate(...)``. Cancelling the task ends the
        call and frees its rows; a full queue is waited for without blocking the event loop."""
        return await front.agenerate(self, args, kwargs)

    def capture_generate(self, timeout: Optional[float] = None, shapes: str = "every") -> bool:
        """Make :meth:`generate`'s shared decode batch now and capture the graphs of every step
        and prompt shape its buckets make, for a warm start (``shapes="first"``: those a first
        burst meets, the largest of each kind among them, the rest captured as calls need
        them): whether they were all captured within ``timeout`` seconds. Without it, each
        shape is captured the first time it is needed, on a thread beside the decode thread,
        which serves meanwhile (by a larger graph or eagerly). Calls may come meanwhile.
        GraphwrapError where the shared batch cannot serve the model
        (``stats()["decode"]["off"]`` says why)."""
        return front.capture_generate(self, timeout, shapes)

    def close(self, cancel: bool = False, timeout: Optional[float] = None) -> bool:
        """Close the shared decode batch of :meth:`generate`: calls queued and running finish
        (``cancel=True``: those not started yet are cancelled); the next ``generate`` makes a
        new batch. Whether its thread ended within ``timeout``."""
        return front.close(self.__dict__, cancel=cancel, timeout=timeout)

    def pipeline(self, batches: Iterable[Any], *, to_host: bool = False, coalesce: bool = False) -> Iterator[Any]:
        """Run the module over an iterable of inputs, copies hidden behind replays.

        Yields one output per batch, in order, each what ``gm(...)`` returns for it. An item
        is a tensor (``gm(t)``), a tuple or list (``gm(*item)``), a dict (``gm(**item)``) or
        :class:`graphwrap.Inputs`. Host inputs are copied on a copy stream straight from pinned
        memory, or through pinned buffers the loop owns when they are pageable; each bucket
        takes turns on two graphs, so the copy of the next batch overlaps the replay of this
        one. Outputs are new tensors on the GPU; with ``to_host=True`` they are pinned host
        tensors, complete when yielded and the caller's to keep. With ``outputs="view"``, GPU
        outputs are views of the graph's static outputs instead, valid until the loop is asked
        for the next item (no copy per batch: clone what you keep).

        Batches above the largest bucket and calls that run eagerly are served by ``gm(...)``,
        in order (its chunked copies overlap the replays). Without ``to_host`` the next item
        is taken from ``batches`` after the loop body has run for the last output; with
        ``to_host=True`` the loop reads two items ahead of the output it yields.

        With ``coalesce=True``, consecutive items of one input signature that are at hand are
        joined along the batch into one replay (up to the largest bucket of rows; the loop
        reads at most one item beyond those it joins) and each output is split back into one
        per item, in order, as the :class:`graphwrap.Batcher` does; until a probe has shown
        that joining gives each item its own result, items go one by one. The default is off:
        over a live queue the loop would wait for an item that has not come yet before it
        serves the ones it holds.
        """
        if coalesce:
            from .loops.coalesce import run_coalesced

            return run_coalesced(self.engine, batches, to_host=to_host)
        from .loops.pipeline import run_pipeline

        return run_pipeline(self.engine, batches, to_host=to_host)


def options_of(gm: GraphedModule) -> dict:
    """The keyword arguments ``gm`` was made with (a function, so that no attribute of the
    wrapped module is shadowed)."""
    return gm.__dict__["_gw_options"].as_kwargs()
