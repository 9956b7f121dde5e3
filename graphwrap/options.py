"""GraphedModule's options, checked once: a record the engine reads and a copy or a pickle of the
module is rebuilt from."""

import numbers
from dataclasses import asdict, dataclass
from typing import Any, Literal, Mapping, Optional, Sequence, Union

from .capture.compiled import compile_options
from .core.buckets import Adaptive, BucketTable
from .core.grid import Grid
from .core.signature import Declarations
from .errors import GraphwrapError

# What each option of GraphedModule takes (its docstring says what each value means).
InputName = Union[str, int]  # an input by keyword name or position
Buckets = Union[None, Literal["default", "exact"], Adaptive, Sequence[int]]
SeqBuckets = Union[None, Literal["default", "exact"], Sequence[int]]
Dims = Union[None, int, Mapping[InputName, Optional[int]]]
PadValues = Union[int, float, bool, Mapping[InputName, Union[int, float, bool]]]
CompileArg = Union[None, bool, Mapping[str, Any]]
StateArg = Union[None, InputName, Sequence[InputName]]
DecodeArg = Union[None, bool, Mapping[str, int]]

# With a sequence dimension, the default largest batch bucket: each sequence bucket multiplies
# the graphs, and requests of text are a few rows (the Batcher joins them up to this).
SEQ_MAX_BATCH = 64


@dataclass(frozen=True)
class Options:
    """The arguments of :class:`graphwrap.GraphedModule`, as given (see its docstring)."""

    buckets: Any = None
    max_batch_size: Optional[int] = None
    batch_dim: Any = 0
    seq_dim: Any = None
    seq_buckets: Any = None
    pad_values: Any = 0
    max_tokens: Optional[int] = None
    warmup_iters: int = 3
    outputs: str = "clone"
    fallback: str = "eager"
    verify: bool = True
    max_keys: int = 16
    compile: Any = None
    max_pool_bytes: Optional[int] = None
    eager_if_faster: bool = True
    state: Any = None
    decode: Any = None

    def check(self):
        """Raise GraphwrapError for an argument that cannot work, naming it and the fix."""
        if self.outputs not in ("clone", "view"):
            raise GraphwrapError(f'outputs must be "clone" or "view", got {self.outputs!r}')
        if self.fallback not in ("eager", "raise"):
            raise GraphwrapError(f'fallback must be "eager" or "raise", got {self.fallback!r}')
        for name in ("verify", "eager_if_faster"):
            if not isinstance(getattr(self, name), bool):
                raise GraphwrapError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("warmup_iters", "max_keys"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise GraphwrapError(f"{name} must be an int >= 1, got {v!r}")
        m = self.max_pool_bytes
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise GraphwrapError(f"max_pool_bytes must be a positive int (bytes), got {m!r}")
        b = self.buckets
        if not (b is None or (isinstance(b, str) and b in ("default", "exact")) or isinstance(b, Adaptive)
                or _sizes(b)):
            raise GraphwrapError(f'buckets must be None, "default", "exact", graphwrap.Adaptive(...) or a list of '
                                 f"batch sizes such as [1, 8, 32], got {b!r}")
        m = self.max_batch_size
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise GraphwrapError(f"max_batch_size must be an int >= 1, got {m!r}")
        if isinstance(self.buckets, Adaptive) and self.max_batch_size is not None:
            raise GraphwrapError("an Adaptive policy picks the largest bucket itself; leave max_batch_size unset")
        if self.seq_dim is None and (self.seq_buckets is not None or self.max_tokens is not None):
            raise GraphwrapError("seq_buckets= and max_tokens= bucket the sequence dimension: pass seq_dim= too")
        _check_decode(self.decode)
        return self

    def as_kwargs(self) -> dict:
        return asdict(self)

    def declarations(self, module) -> Declarations:
        return Declarations(module, self.batch_dim, self.seq_dim, self.pad_values, self.state)

    def compile_opts(self) -> Optional[dict]:
        return compile_options(self.compile)

    def grid(self, compile_opts, has_seq: bool) -> Grid:
        """The bucket grid. With one compile for every bucket (``dynamic="batch"``), batches of
        one row run in the bucket of two: a size-1 batch dimension would make dynamo compile
        a static graph of its own."""
        buckets = self.buckets.buckets if isinstance(self.buckets, Adaptive) else self.buckets
        top = self.max_batch_size
        if top is None and has_seq and buckets is None:
            top = SEQ_MAX_BATCH  # text requests are a few rows: joined calls go up to this
        table = BucketTable(buckets, top)
        if (compile_opts is not None and compile_opts["dynamic"] == "batch" and not isinstance(self.buckets, Adaptive)
                and (buckets is None or buckets in ("default", "exact")) and table.max > 1):
            table = BucketTable([b for b in table.buckets if b > 1])
        return Grid(table, self.seq_buckets, has_seq, self.max_tokens)


def _sizes(b) -> bool:
    """Whether ``b`` is a non-empty list (or tuple, range) of batch sizes >= 1."""
    if isinstance(b, (str, bytes, dict)) or not hasattr(b, "__iter__"):
        return False
    sizes = list(b)
    return bool(sizes) and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and int(x) >= 1 for x in sizes)


def _check_decode(value):
    if value is None or value is True or value is False:
        return
    keys = {"rows", "max_len", "max_queue", "cache_memory", "paged", "prefix_caching", "prefill_budget",
            "prefill_whole", "prefill_beside", "kv_cache_dtype"}
    if not isinstance(value, dict) or set(value) - keys:
        raise GraphwrapError("decode must be True, False or a dict of rows=, max_len=, max_queue=, cache_memory=, "
                             "paged=, prefix_caching=, prefill_budget=, prefill_whole=, prefill_beside=, "
                             f"kv_cache_dtype=; got {value!r}")
    if value.get("kv_cache_dtype") in ("fp8", "fp8_e4m3") and value.get("paged") is False:
        raise GraphwrapError("decode['kv_cache_dtype']='fp8' keeps the cache in the paged pool; it cannot be "
                             "paged=False (leave paged out, or use kv_cache_dtype='auto')")
    for k, v in value.items():
        if k == "kv_cache_dtype":
            if v not in (None, "auto", "fp8", "fp8_e4m3"):
                raise GraphwrapError(f"decode['kv_cache_dtype'] must be 'auto' (the model's dtype) or 'fp8' (E4M3 "
                                     f"with scales per layer), got {v!r}")
            continue
        if k == "cache_memory":
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not 0 < float(v) <= 1:
                raise GraphwrapError(f"decode['cache_memory'] must be a fraction in (0, 1], got {v!r}")
        elif k == "paged":
            if v is not None and not isinstance(v, bool):
                raise GraphwrapError(f"decode['paged'] must be True, False or None, got {v!r}")
        elif k == "prefix_caching":
            if not isinstance(v, bool):
                raise GraphwrapError(f"decode['prefix_caching'] must be True or False, got {v!r}")
        elif k == "prefill_budget":
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise GraphwrapError(f"decode['prefill_budget'] must be an int >= 0 (0: one piece a turn), got {v!r}")
        elif k == "prefill_beside":
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise GraphwrapError(f"decode['prefill_beside'] must be an int >= 0 (0: no bound on the prompt tokens a "
                                     f"turn admits while rows decode), got {v!r}")
        elif k == "prefill_whole":
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise GraphwrapError(f"decode['prefill_whole'] must be an int >= 0 (0: a long prompt always goes in "
                                     f"pieces), got {v!r}")
        elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise GraphwrapError(f"decode[{k!r}] must be an int >= 1, got {v!r}")
