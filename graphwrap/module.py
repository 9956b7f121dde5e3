"""GraphedModule: bucketed CUDA-graph capture and replay for any nn.Module."""

import logging
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from . import _compat
from .buckets import Adaptive, BucketTable, padded_rows
from .capture import CaptureFailed, Replica, capture_bucket
from .compiled import CompiledForward, compile_options, unavailable_reason
from .errors import GraphwrapError
from .tree import (
    BATCHED,
    CONST,
    UnsupportedInput,
    batch_size_of,
    flatten_inputs,
    flatten_outputs,
    map_tensors,
    tensor_meta,
)

logger = logging.getLogger("graphwrap")

Tensor = torch.Tensor
_data_ptr = Tensor.data_ptr

# Bumped by global hooks whenever any module gets a new parameter, buffer or submodule; a
# GraphedModule re-reads its module's tensors when it sees a new value.
_GENERATION = [0]
_HOOKS_INSTALLED = []
_SINGLE_TENSOR_SPEC = flatten_inputs((torch.empty(0),), {})[1]
# (stream id, device index, device type) of the current stream, without building a Stream.
_current_stream_id = getattr(torch._C, "_cuda_getCurrentStream", None)


def _bump(*_args):
    _GENERATION[0] += 1


def _install_hooks():
    if not _HOOKS_INSTALLED:
        for register in _compat.registration_hooks():
            _HOOKS_INSTALLED.append(register(_bump))
        _HOOKS_INSTALLED.append(True)


class _Bucket:
    __slots__ = ("size", "replicas", "leased", "failed", "over_budget", "replays", "rows", "padded_rows",
                 "eager_calls", "capture_s", "verify_s", "pool_bytes", "pool_estimate", "compiled", "compile_s",
                 "compiled_graphs")

    def __init__(self, size):
        self.size = size
        self.replicas: List[Replica] = []  # [0] serves gm(...); the others are leased to loops
        self.leased = set()
        self.failed: Optional[str] = None
        self.over_budget = False  # not captured for the pool budget: a larger bucket serves its batches
        self.replays = self.rows = self.padded_rows = self.eager_calls = 0
        self.capture_s = self.verify_s = self.compile_s = 0.0
        self.pool_bytes = 0
        self.pool_estimate = 0  # with max_pool_bytes: the pool growth estimated before capture
        self.compiled: Optional[bool] = None  # runs Inductor's kernels (None: compile not asked)
        self.compiled_graphs = 0


class _Key:
    __slots__ = ("label", "in_spec", "device", "autocast", "kinds", "out_spec", "buckets", "failed",
                 "eager_calls", "seen_as")

    def __init__(self, label, in_spec, device, autocast, seen_as):
        self.label = label
        # The inputs as the captured forward sees them (its static inputs: every tensor on the
        # module's device). Keys that differ only in where the caller's tensors are share it,
        # and with it torch.compile's compiled code.
        self.seen_as = seen_as
        self.in_spec = in_spec
        self.device = device
        self.autocast = autocast
        self.kinds = None
        self.out_spec = None
        self.buckets: Dict[int, _Bucket] = {}
        self.failed: Optional[str] = None
        self.eager_calls = 0


class _Store:
    """The graphs and their buffers, apart from the module so a finalizer can release them."""

    def __init__(self):
        self.keys: Dict[Any, _Key] = {}
        self.device: Optional[torch.device] = None
        self.pool = None
        # Bumped by release(): a pipeline holding graphs of an older epoch drops them.
        self.epoch = 0

    def release(self):
        if self.keys and self.device is not None and torch.cuda.is_initialized():
            # A replay may still be running: its memory must not be handed out before it ends.
            torch.cuda.synchronize(self.device)
        self.keys.clear()
        self.pool = None
        self.epoch += 1


def _release_store(store: _Store):
    try:
        store.release()
    except Exception:  # noqa: BLE001 - never raise from a finalizer (interpreter shutdown)
        pass


def _describe_key(in_spec, meta, autocast) -> str:
    spec_args, spec_kw = in_spec
    it = iter(meta)

    def one(spec):
        tag = spec[0]
        if tag == "T":
            shape, dtype, device = next(it)
            dims = ", ".join(str(d) for d in shape)
            return f"Tensor[B{', ' if dims else ''}{dims}] {str(dtype).replace('torch.', '')} {device}"
        if tag == "C":
            return repr(spec[2])
        if tag in ("tuple", "list"):
            inner = ", ".join(one(s) for s in spec[1])
            return f"({inner})" if tag == "tuple" else f"[{inner}]"
        if tag in ("dict", "defaultdict"):
            inner = "{" + ", ".join(f"{k!r}: {one(s)}" for k, s in zip(spec[2], spec[3])) + "}"
            return inner if spec[1] is dict else f"{spec[1].__name__}({inner})"
        return f"{spec[1].__name__}(" + ", ".join(one(s) for s in spec[2]) + ")"

    parts = [one(s) for s in spec_args] + [f"{k}={one(s)}" for k, s in spec_kw]
    text = "(" + ", ".join(parts) + ")"
    if autocast is not None:
        text += f" autocast={str(autocast).replace('torch.', '')}"
    return text


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
        max_batch_size: largest bucket of ``"default"`` and ``"exact"`` (256). Larger batches
            are split into chunks of at most the largest bucket, each served by a replay, and joined.
        compile: ``True`` or a dict of ``torch.compile`` options (``mode``, ``options``,
            ``dynamic``, ``fullgraph``). The forward is compiled by Inductor without its CUDA
            graphs, and each bucket's graph captures the kernels compiled for its shape
            (``dynamic=False`` unless given). If compiling fails, or Inductor cannot run here,
            the plain forward is captured instead, with a warning and the reason in ``stats()``.
        max_pool_bytes: memory budget of the graph pool. A bucket is captured only if the
            pool's growth, estimated from the peak memory of a warm-up run, fits in what is left;
            batches of a bucket left out go to the next larger captured bucket (or run eagerly
            if there is none). Call :meth:`capture` first so that the largest buckets are
            captured first. Estimating resets ``torch.cuda``'s peak memory statistics.
        batch_dim: the dimension of every tensor input and batched output that holds the batch.
        warmup_iters: eager runs on a side stream before each capture.
        outputs: ``"clone"`` returns tensors the caller owns. ``"view"`` returns views of the
            static output buffers, with no copy.
        fallback: ``"eager"`` runs the module eagerly for inputs whose capture failed, logging
            the reason once; ``"raise"`` raises :class:`GraphwrapError` instead.
        verify: after each capture, replay on the warm-up inputs and compare with eager, then
            replay with other padding rows to catch models that mix rows of the batch.
        max_keys: how many input signatures get graphs; calls with further signatures run eagerly.

    .. warning::
        With ``outputs="view"``, the returned tensors are overwritten by the next call of this
        GraphedModule (from any thread). Clone what you keep.

    .. warning::
        The forward is captured once per bucket. Python-side state it reads (flags, plain tensor
        attributes that are not parameters or buffers, random numbers drawn on the host) is
        frozen at capture: call :meth:`reset` after changing it.

    .. warning::
        Outputs never require grad. A call whose inputs require grad with grad mode on, or with
        the module in training mode, runs eagerly.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        buckets: Optional[Sequence[int]] = None,
        max_batch_size: Optional[int] = None,
        batch_dim: int = 0,
        warmup_iters: int = 3,
        outputs: str = "clone",
        fallback: str = "eager",
        verify: bool = True,
        max_keys: int = 16,
        compile=None,
        max_pool_bytes: Optional[int] = None,
    ):
        if not isinstance(module, nn.Module):
            raise GraphwrapError(f"GraphedModule wraps an nn.Module, got {type(module).__name__}")
        if outputs not in ("clone", "view"):
            raise GraphwrapError(f'outputs must be "clone" or "view", got {outputs!r}')
        if fallback not in ("eager", "raise"):
            raise GraphwrapError(f'fallback must be "eager" or "raise", got {fallback!r}')
        if not isinstance(batch_dim, int) or isinstance(batch_dim, bool) or batch_dim < 0:
            raise GraphwrapError(f"batch_dim must be a non-negative int, got {batch_dim!r}")
        if not isinstance(warmup_iters, int) or warmup_iters < 1:
            raise GraphwrapError(f"warmup_iters must be an int >= 1, got {warmup_iters!r}")
        if not isinstance(max_keys, int) or max_keys < 1:
            raise GraphwrapError(f"max_keys must be an int >= 1, got {max_keys!r}")
        if max_pool_bytes is not None and (not isinstance(max_pool_bytes, int) or max_pool_bytes < 1):
            raise GraphwrapError(f"max_pool_bytes must be a positive int (bytes), got {max_pool_bytes!r}")
        compile_opts = compile_options(compile)
        adaptive = None
        if isinstance(buckets, Adaptive):
            adaptive = buckets
            if max_batch_size is not None:
                raise GraphwrapError("an Adaptive policy picks the largest bucket itself; leave max_batch_size unset")
            buckets = adaptive.buckets  # None until the warm-up calls are counted
        table = BucketTable(buckets, max_batch_size)
        super().__init__()
        _install_hooks()
        object.__setattr__(self, "_gw_module", module)
        # Share the module's tables, so parameters(), state_dict keys and nesting inside a
        # parent module are exactly the module's own.
        object.__setattr__(self, "_parameters", module._parameters)
        object.__setattr__(self, "_buffers", module._buffers)
        object.__setattr__(self, "_modules", module._modules)
        object.__setattr__(self, "_non_persistent_buffers_set", module._non_persistent_buffers_set)
        self.training = module.training
        d = self.__dict__
        d["_gw_table"] = table
        d["_gw_adaptive"] = adaptive if adaptive is not None and adaptive.buckets is None else None
        d["_gw_policy"] = adaptive
        d["_gw_compile_opts"] = compile_opts
        d["_gw_compiled"] = None  # CompiledForward, made at the first capture
        d["_gw_compile_off"] = None  # why compile= was given up, if it was
        d["_gw_max_pool_bytes"] = max_pool_bytes
        d["_gw_batch_dim"] = batch_dim
        d["_gw_warmup_iters"] = warmup_iters
        d["_gw_clone"] = outputs == "clone"
        d["_gw_outputs"] = outputs
        d["_gw_fallback"] = fallback
        d["_gw_verify"] = bool(verify)
        d["_gw_max_keys"] = max_keys
        d["_gw_lock"] = threading.RLock()
        d["_gw_store"] = _Store()
        d["_gw_finalizer"] = weakref.finalize(self, _release_store, d["_gw_store"])
        d["_gw_eager"] = {}  # reason -> calls
        d["_gw_logged"] = set()
        d["_gw_last_stream"] = None
        d["_gw_last_sid"] = None
        d["_gw_gen"] = -1
        d["_gw_tensors"] = []
        d["_gw_ptrs"] = None  # data pointers of the module's tensors when the graphs were captured
        d["_gw_keepalive"] = None
        d["_gw_device"] = None

    # ------------------------------------------------------------------ drop-in behaviour

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self.__dict__["_gw_module"]

    @property
    def buckets(self):
        return self.__dict__["_gw_table"].buckets

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
        return (f"module={type(self.module).__name__}, buckets={list(self.buckets)}, "
                f"outputs={self._gw_outputs!r}, fallback={self._gw_fallback!r}")

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, *args, **kwargs):
        # In-place copies keep the tensors the graphs read, so the next replay sees the new
        # weights; assign=True swaps tensors, which the pointer check below catches.
        return self.module.load_state_dict(state_dict, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        return self.module._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        # .to(), .cuda(), .half(), .float() ... all come here: graphs of the old tensors go.
        self.reset()
        self.module._apply(fn, *args, **kwargs)
        return self

    def train(self, mode: bool = True):
        self.module.train(mode)
        self.training = mode
        return self

    # ------------------------------------------------------------------ public API

    def reset(self):
        """Drop every graph and static buffer; the next calls capture again."""
        with self._gw_lock:
            store = self._gw_store
            store.release()
            d = self.__dict__
            d["_gw_ptrs"] = None
            d["_gw_keepalive"] = None
            d["_gw_last_stream"] = None
            d["_gw_last_sid"] = None
            d["_gw_device"] = None
            d["_gw_gen"] = -1

    def capture(self, *args, **kwargs):
        """Capture every bucket for the signature of these inputs now, largest first.

        The inputs serve as samples: buckets smaller than their batch take its first rows,
        larger ones repeat its rows. Progress (bucket, time, pool memory) is logged at INFO on
        the ``graphwrap`` logger. Returns ``stats()`` of this signature.
        """
        prep = self._prepare(args, kwargs)
        if isinstance(prep, str):
            raise GraphwrapError(f"cannot capture: {prep}")
        key, ks_args = prep
        leaves, n, spec, meta, autocast, device = ks_args
        with self._gw_lock:
            ks = self._key_for(key, spec, meta, autocast, device, leaves)
            if ks is None:
                raise GraphwrapError(
                    f"cannot capture: this GraphedModule already holds max_keys={self._gw_max_keys} "
                    "input signatures; pass a larger max_keys= or call reset()"
                )
            t0 = time.perf_counter()
            for size in sorted(self._gw_table.buckets, reverse=True):
                if ks.failed:
                    break
                b = ks.buckets.get(size)
                if b is None or (not b.replicas and not b.failed):
                    self._capture(ks, size, leaves, n)
            logger.info("graphwrap: captured %d buckets of %s in %.2f s", len(ks.buckets), ks.label,
                        time.perf_counter() - t0)
            return self._key_stats(ks)

    def stats(self) -> dict:
        """Per signature and bucket: captured, replays, real and padded rows, capture time, fallbacks.

        Also the eager calls by reason and the memory the graph pool and static inputs hold.
        """
        with self._gw_lock:
            keys = [self._key_stats(ks) for ks in self._gw_store.keys.values()]
            rows = sum(b["rows"] for k in keys for b in k["buckets"].values())
            padded = sum(b["padded_rows"] for k in keys for b in k["buckets"].values())
            cf = self._gw_compiled
            adaptive = self._gw_adaptive
            return {
                "keys": keys,
                "buckets": None if adaptive is not None else list(self._gw_table.buckets),
                "bucket_policy": repr(self._gw_policy) if self._gw_policy is not None else None,
                "compile": None if self._gw_compile_opts is None else {
                    "options": dict(self._gw_compile_opts),
                    "off": self._gw_compile_off,
                    "graphs": cf.graphs if cf is not None else 0,
                    "compile_s": sum(b["compile_s"] for k in keys for b in k["buckets"].values()),
                },
                "eager_calls": dict(self._gw_eager),
                "graph_pool_bytes": sum(k["pool_bytes"] for k in keys),
                "static_input_bytes": sum(k["static_input_bytes"] for k in keys),
                "rows": rows,
                "padded_rows": padded,
                "padded_share": padded / (rows + padded) if rows + padded else 0.0,
                "device": str(self._gw_store.device) if self._gw_store.device is not None else None,
            }

    @staticmethod
    def _key_stats(ks: _Key) -> dict:
        buckets = {}
        for size, b in sorted(ks.buckets.items()):
            buckets[size] = {
                "captured": bool(b.replicas),
                "graphs": len(b.replicas),
                "failed": b.failed,
                "over_budget": b.over_budget,
                "compiled": b.compiled,
                "compiled_graphs": b.compiled_graphs,
                "compile_s": b.compile_s,
                "replays": b.replays,
                "rows": b.rows,
                "padded_rows": b.padded_rows,
                "eager_calls": b.eager_calls,
                "capture_s": b.capture_s,
                "verify_s": b.verify_s,
                "pool_bytes": b.pool_bytes,
                "pool_estimate": b.pool_estimate,
            }
        return {
            "key": ks.label,
            "status": "eager" if ks.failed else "graphed",
            "reason": ks.failed,
            "eager_calls": ks.eager_calls,
            "buckets": buckets,
            "pool_bytes": sum(b["pool_bytes"] for b in buckets.values()),
            "static_input_bytes": sum(r.nbytes() for b in ks.buckets.values() for r in b.replicas),
        }

    # ------------------------------------------------------------------ the call

    def forward(self, *args, **kwargs):
        prep = self._prepare(args, kwargs)
        if type(prep) is str:
            return self._eager(args, kwargs, prep)
        key, (leaves, n, spec, meta, autocast, device) = prep
        with self._gw_lock:
            ks = self._gw_store.keys.get(key)
            if ks is None:
                ks = self._key_for(key, spec, meta, autocast, device, leaves)
                if ks is None:
                    return self._eager(args, kwargs, f"more than max_keys={self._gw_max_keys} input signatures")
            if ks.failed is not None:
                ks.eager_calls += 1
                return self._eager(args, kwargs, ks.failed)
            table = self._gw_table
            if n <= table.max:
                return self._run_one(ks, leaves, n, table.bucket_for(n), args, kwargs)
            return self._run_chunked(ks, leaves, n, args, kwargs)

    def _prepare(self, args, kwargs):
        """The graph key and call facts, or a string saying why this call runs eagerly."""
        module = self.__dict__["_gw_module"]
        if module.training:
            return "the module is in training mode"
        if _GENERATION[0] != self._gw_gen:
            self._refresh_tensors()
        if self._gw_ptrs is not None and tuple(map(_data_ptr, self._gw_tensors)) != self._gw_ptrs:
            self._tensors_moved()
        if not kwargs and len(args) == 1 and type(args[0]) is Tensor:
            # The common call, gm(x): the same facts as below with a fraction of the host work.
            x = args[0]
            device = self._gw_device
            bd = self._gw_batch_dim
            shape = x.shape
            if (device is not None and len(shape) > bd and shape[bd] and self._gw_adaptive is None
                    and not (x.requires_grad and torch.is_grad_enabled())):
                meta = ((shape[:bd] + shape[bd + 1:], x.dtype, x.device),)
                autocast = _compat.autocast_state("cuda")
                spec = _SINGLE_TENSOR_SPEC
                return (spec, meta, autocast), ([x], shape[bd], spec, meta, autocast, device)
            leaves = [x]
            spec = _SINGLE_TENSOR_SPEC
        else:
            try:
                leaves, spec = flatten_inputs(args, kwargs)
            except UnsupportedInput as e:
                return str(e)
        if not leaves:
            return "the call has no tensor inputs to batch"
        device = self._gw_device or self._find_device(leaves)
        if device is None:
            return "the module is not on a CUDA device" if _compat.cuda_available() else "CUDA is not available"
        if torch.is_grad_enabled():
            for t in leaves:
                if t.requires_grad:
                    return "an input requires grad and grad mode is on"
        bd = self._gw_batch_dim
        n = batch_size_of(leaves, bd)
        if n == 0:
            return "the batch is empty"
        if self._gw_adaptive is not None:
            return self._observe(n)
        meta = tensor_meta(leaves, bd)
        autocast = _compat.autocast_state("cuda")
        return (spec, meta, autocast), (leaves, n, spec, meta, autocast, device)

    def _observe(self, n: int) -> str:
        """Count a batch size for the Adaptive policy; the call runs eagerly."""
        with self._gw_lock:
            adaptive = self._gw_adaptive
            if adaptive is not None:
                buckets = adaptive.observe(n)
                if buckets is not None:
                    d = self.__dict__
                    d["_gw_table"] = BucketTable(buckets)
                    d["_gw_adaptive"] = None
                    hist = adaptive.histogram
                    rows = sum(k * v for k, v in hist.items())
                    pad = padded_rows(buckets, hist)
                    logger.info("graphwrap: adaptive buckets %s from %d calls; %.1f%% of their rows would be padding",
                                buckets, adaptive.seen, 100.0 * pad / (rows + pad))
        return f"adaptive buckets: counting batch sizes over the first {self._gw_policy.warmup_calls} calls"

    def _find_device(self, leaves):
        module = self.module
        t = next(iter(module.parameters()), None)
        if t is None:
            t = next(iter(module.buffers()), None)
        if t is None:
            # A module with no tensors of its own runs where its inputs are, call by call.
            t = next((x for x in leaves if x.is_cuda), None)
            return None if t is None else t.device
        if not t.is_cuda:
            return None
        self.__dict__["_gw_device"] = t.device
        return t.device

    def _refresh_tensors(self):
        module = self.module
        d = self.__dict__
        d["_gw_tensors"] = list(module.parameters()) + list(module.buffers())
        d["_gw_gen"] = _GENERATION[0]
        d["_gw_device"] = None
        if d["_gw_ptrs"] is not None and tuple(map(_data_ptr, d["_gw_tensors"])) != d["_gw_ptrs"]:
            self._tensors_moved()

    def _tensors_moved(self):
        self._log_once("moved", logging.INFO,
                       "graphwrap: the module's parameters or buffers were replaced or moved; "
                       "dropping its graphs, they are captured again on the next calls")
        self.reset()
        self._refresh_tensors()

    def _key_for(self, key, spec, meta, autocast, device, leaves) -> Optional[_Key]:
        store = self._gw_store
        ks = store.keys.get(key)
        if ks is not None:
            return ks
        if len(store.keys) >= self._gw_max_keys:
            return None
        for i, t in enumerate(leaves):
            if t.is_cuda and t.device != device:
                raise GraphwrapError(
                    f"input tensor #{i} is on {t.device} but the module is on {device}; move it with "
                    f".to({str(device)!r}) (CPU tensors are copied over for you)"
                )
        if store.device is None:
            store.device = device
        elif store.device != device:
            self.reset()
            store.device = device
        ks = _Key(_describe_key(spec, meta, autocast), spec, device, autocast,
                  _describe_key(spec, tuple((shape, dtype, device) for shape, dtype, _ in meta), autocast))
        store.keys[key] = ks
        return ks

    def _capture(self, ks: _Key, size: int, leaves, n: int) -> _Bucket:
        b = ks.buckets.get(size)
        if b is None:
            b = ks.buckets[size] = _Bucket(size)
        store = self._gw_store
        device = ks.device
        bd = self._gw_batch_dim
        with torch.cuda.device(device):
            if store.pool is None:
                store.pool = torch.cuda.graph_pool_handle()
            if self._gw_ptrs is None:
                self._refresh_tensors()
                d = self.__dict__
                d["_gw_keepalive"] = list(d["_gw_tensors"])  # never replay on freed memory
                d["_gw_ptrs"] = tuple(map(_data_ptr, d["_gw_tensors"]))
            m = min(n, size)
            sample = [t.narrow(bd, 0, m).to(device) for t in leaves]
            compiled = self._compiled_forward()
            budget_left = self._budget_left()
            try:
                rep, info = capture_bucket(
                    module=self.module, device=device, pool=store.pool,
                    in_spec=ks.in_spec, sample=sample, size=size, batch_dim=bd,
                    warmup_iters=self._gw_warmup_iters, autocast_dtype=ks.autocast,
                    verify=self._gw_verify, kinds=ks.kinds, out_spec=ks.out_spec,
                    compiled=compiled, budget_left=budget_left,
                )
            except CaptureFailed as e:
                if e.scope == "compile":
                    if e.pool_lost:
                        store.pool = None
                    self._give_up_compile(e.reason)
                    return self._capture(ks, size, leaves, n)  # the plain forward
                self._capture_failed(ks, b, e)
                return b
        ks.kinds, ks.out_spec = info["kinds"], info["out_spec"]
        self._add_replica(ks, b, rep, info, compiled)
        if compiled is not None:
            how = (f"compiled, {info['compiled_graphs']} graphs in {info['compile_s']:.2f} s" if b.compiled
                   else "NOT compiled: torch.compile compiled nothing for this shape")
            level = logging.INFO if b.compiled else logging.WARNING
        else:
            how, level = "plain forward", logging.INFO
        logger.log(level, "graphwrap: captured bucket %d of %s in %.1f ms (%s; verify %.1f ms), graph pool +%.1f MiB",
                   size, ks.label, 1e3 * info["capture_s"], how, 1e3 * info["verify_s"], info["pool_bytes"] / 2**20)
        return b

    def _add_replica(self, ks: _Key, b: _Bucket, rep: Replica, info: dict, compiled):
        b.replicas.append(rep)
        b.capture_s += info["capture_s"]
        b.verify_s += info["verify_s"]
        b.pool_bytes += info["pool_bytes"]
        b.pool_estimate = max(b.pool_estimate, info["pool_estimate"])
        b.compile_s += info["compile_s"]
        b.compiled_graphs += info["compiled_graphs"]
        if compiled is None:
            b.compiled = False if self._gw_compile_opts is not None else None
            return
        # Compiled kernels ran if this warm-up compiled a graph, or this shape (any shape, with
        # dynamic shapes) was compiled before, by this key or one whose static inputs look the
        # same (dynamo's cache outlives reset()): otherwise dynamo ran the forward uncompiled.
        seen = compiled.shapes
        dynamic = self._gw_compile_opts["dynamic"] is not False
        ran = (info["compiled_graphs"] > 0 or (ks.seen_as, b.size) in seen
               or (dynamic and any(label == ks.seen_as for label, _ in seen)))
        if ran:
            seen.add((ks.seen_as, b.size))
        b.compiled = ran if b.compiled is None else (b.compiled and ran)

    def _compiled_forward(self) -> Optional[CompiledForward]:
        """The compiled forward to capture, or None for the plain one."""
        opts = self._gw_compile_opts
        if opts is None or self._gw_compile_off is not None:
            return None
        cf = self._gw_compiled
        if cf is None:
            reason = unavailable_reason()
            if reason is not None:
                self._give_up_compile(reason)
                return None
            cf = self.__dict__["_gw_compiled"] = CompiledForward(self.module, opts)
        return cf

    def _give_up_compile(self, reason: str):
        self.__dict__["_gw_compile_off"] = reason
        msg = f"graphwrap: compile= given up ({reason}); capturing the plain forward"
        if self._gw_fallback == "raise":
            raise GraphwrapError(f"{msg}. Pass fallback=\"eager\" to accept the plain forward")
        self._log_once(("compile",), logging.WARNING, msg)

    def _budget_left(self) -> Optional[int]:
        budget = self._gw_max_pool_bytes
        if budget is None:
            return None
        return budget - sum(b.pool_bytes for ks in self._gw_store.keys.values() for b in ks.buckets.values())

    def _capture_failed(self, ks: _Key, b: _Bucket, e: CaptureFailed):
        if e.pool_lost:
            self._gw_store.pool = None  # graphs already in it keep their memory; new ones get a new pool
        if e.scope == "budget":
            b.failed = e.reason
            b.over_budget = True
            b.pool_estimate = e.pool_estimate
            self._log_once(("budget", ks.label, b.size), logging.INFO,
                           f"graphwrap: bucket {b.size} of {ks.label} not captured: {e.reason}; its batches go "
                           "to the next larger captured bucket")
            return
        if e.scope == "bucket":
            b.failed = e.reason
            torch.cuda.empty_cache()
        else:
            ks.failed = e.reason
        msg = f"graphwrap: capture of bucket {b.size} for {ks.label} failed: {e.reason}"
        if self._gw_fallback == "raise":
            err = GraphwrapError(f"{msg}. Pass fallback=\"eager\" to run such inputs eagerly instead")
            raise err from (e.cause or e)
        self._log_once(("capture", ks.label, b.size if e.scope == "bucket" else None), logging.WARNING,
                       f"{msg}; running {'this bucket' if e.scope == 'bucket' else 'these inputs'} eagerly")

    def pipeline(self, batches, *, to_host: bool = False):
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
        in order, without overlap. Without ``to_host`` the next item is taken from ``batches``
        after the loop body has run for the last output; with ``to_host=True`` the loop reads
        two items ahead of the output it yields.
        """
        from .pipeline import run_pipeline

        return run_pipeline(self, batches, to_host=to_host)

    def _take_lease(self, ks: _Key, size: int, leaves, n: int, count: int):
        """``count`` graphs of this bucket for a loop's sole use (captured as needed), or None."""
        b = ks.buckets.get(size)
        if b is None or (not b.replicas and not b.failed):
            b = self._capture(ks, size, leaves, n)
        if b.failed is not None or ks.failed is not None:
            return None
        taken = []
        for i in range(1, len(b.replicas)):
            if len(taken) == count:
                break
            if i not in b.leased:
                taken.append(i)
        while len(taken) < count:
            if not self._capture_replica(ks, b):
                return None
            taken.append(len(b.replicas) - 1)
        b.leased.update(taken)
        return [b.replicas[i] for i in taken]

    def _return_lease(self, replicas):
        for ks in self._gw_store.keys.values():
            for b in ks.buckets.values():
                for i, r in enumerate(b.replicas):
                    if any(r is x for x in replicas):
                        b.leased.discard(i)

    def _capture_replica(self, ks: _Key, b: _Bucket) -> bool:
        """One more graph of a captured bucket, with the first graph's static inputs as sample."""
        store = self._gw_store
        first = b.replicas[0]
        compiled = self._gw_compiled if b.compiled else None
        with torch.cuda.device(ks.device):
            if store.pool is None:
                store.pool = torch.cuda.graph_pool_handle()
            try:
                rep, info = capture_bucket(
                    module=self.module, device=ks.device, pool=store.pool,
                    in_spec=ks.in_spec, sample=first.static_inputs, size=b.size,
                    batch_dim=self._gw_batch_dim, warmup_iters=1, autocast_dtype=ks.autocast,
                    verify=self._gw_verify, kinds=ks.kinds, out_spec=ks.out_spec,
                    compiled=compiled, budget_left=self._budget_left(),
                )
            except CaptureFailed as e:
                if e.scope == "budget":  # the loop runs this bucket through gm(...) instead
                    return False
                if e.scope == "compile" and e.pool_lost:
                    store.pool = None
                if e.scope != "compile":
                    self._capture_failed(ks, b, e)
                return False
        self._add_replica(ks, b, rep, info, compiled)
        return True

    def _order_stream(self, device):
        """The caller's current stream, made to wait for the last call's work if it is another.

        The static buffers and the pool are shared by every caller: work issued on another
        stream (another thread's, say) must not touch them before the last call's work is done.
        """
        last = self._gw_last_stream
        if _current_stream_id is not None and last is not None:
            # (stream id, device index, device type): one C call, no Stream object built.
            if _current_stream_id(device.index) == self._gw_last_sid:
                return last
        cur = torch.cuda.current_stream(device)
        if last is not None and last != cur:
            cur.wait_stream(last)
        d = self.__dict__
        d["_gw_last_stream"] = cur
        d["_gw_last_sid"] = _current_stream_id(device.index) if _current_stream_id is not None else None
        return cur

    def _replay(self, ks: _Key, leaves, n: int, size: int):
        """Copy the real rows in and replay; the static outputs cut to n rows, or None if eager."""
        b = ks.buckets.get(size)
        if b is None or (not b.replicas and not b.failed):
            b = self._capture(ks, size, leaves, n)
            if ks.failed is not None:
                return None
        if b.failed is not None:
            if b.over_budget:
                b = self._larger_captured(ks, size)
            if b is None or b.failed is not None:
                ks.buckets[size].eager_calls += 1
                return None
            size = b.size
        rep = b.replicas[0]
        self._order_stream(ks.device)
        for dst, src in zip(rep.inputs_for(n), leaves):
            dst.copy_(src)
        rep.graph.replay()
        b.replays += 1
        b.rows += n
        b.padded_rows += size - n
        return rep

    def _larger_captured(self, ks: _Key, size: int) -> Optional[_Bucket]:
        for s in self._gw_table.buckets:
            if s > size:
                b = ks.buckets.get(s)
                if b is not None and b.replicas and b.failed is None:
                    return b
        if self._gw_fallback == "raise":
            raise GraphwrapError(
                f"bucket {size} of {ks.label} is over max_pool_bytes and no larger bucket is captured; "
                "raise max_pool_bytes, call capture() first (it takes the largest buckets first) or pass "
                'fallback="eager"'
            )
        return None

    def _run_one(self, ks: _Key, leaves, n: int, size: int, args, kwargs):
        device = ks.device
        if device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                return self._run_one(ks, leaves, n, size, args, kwargs)
        rep = self._replay(ks, leaves, n, size)
        if rep is None:
            return self._eager(args, kwargs, ks.failed or ks.buckets[size].failed)
        outs = rep.outputs_for(n)
        if self._gw_clone:
            outs = [o.clone() if is_t else o for o, is_t in zip(outs, rep.is_tensor)]
        return ks.out_spec.rebuild(outs)

    def _run_chunked(self, ks: _Key, leaves, n: int, args, kwargs):
        """A batch above the largest bucket: one replay per chunk, outputs joined into new tensors."""
        device = ks.device
        if device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                return self._run_chunked(ks, leaves, n, args, kwargs)
        bd = self._gw_batch_dim
        joined = None
        for start, rows, size in self._gw_table.chunks(n):
            part = [t.narrow(bd, start, rows) for t in leaves]
            rep = self._replay(ks, part, rows, size)
            if rep is not None:
                outs = rep.outputs_for(rows)
            else:
                if ks.failed is not None:  # the key failed at capture: the whole batch runs eagerly
                    return self._eager(args, kwargs, ks.failed)
                p_args, p_kwargs = _narrow_call(args, kwargs, bd, start, rows)
                with torch.no_grad():
                    outs, _ = flatten_outputs(self._eager_run(p_args, p_kwargs))
            if joined is None:
                joined = []
                for o, kind in zip(outs, ks.kinds):
                    if kind == BATCHED:
                        shape = list(o.shape)
                        shape[bd] = n
                        joined.append(o.new_empty(shape))
                    elif kind == CONST:
                        joined.append(o)
                    else:
                        joined.append(o.clone())
            for j, (o, kind) in enumerate(zip(outs, ks.kinds)):
                if kind == BATCHED:
                    joined[j].narrow(bd, start, rows).copy_(o)
        return ks.out_spec.rebuild(joined)

    # ------------------------------------------------------------------ eager

    def _eager_run(self, args, kwargs):
        device = self._gw_device
        if device is not None:
            try:
                args, kwargs = map_tensors(lambda t: t.to(device) if t.device.type == "cpu" else t, (args, kwargs))
            except GraphwrapError:
                pass  # inputs in a container that cannot be rebuilt: the module gets them as given
        return self.module(*args, **kwargs)

    def _eager(self, args, kwargs, reason: str):
        counts = self._gw_eager
        counts[reason] = counts.get(reason, 0) + 1
        if counts[reason] == 1:
            level = logging.INFO if reason.startswith(("the module", "CUDA")) else logging.WARNING
            self._log_once(("eager", reason), level, f"graphwrap: running eagerly: {reason}")
        return self._eager_run(args, kwargs)

    def _log_once(self, tag, level, msg):
        logged = self._gw_logged
        if tag not in logged:
            logged.add(tag)
            logger.log(level, msg)


def _narrow_call(args, kwargs, bd, start, rows):
    return map_tensors(lambda t: t.narrow(bd, start, rows), (args, kwargs))
