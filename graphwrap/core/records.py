"""What the engine keeps: per input signature a :class:`Key`, per bucket of it a :class:`Bucket`,
per capture a :class:`Graph`. Records only: the engine makes and changes them, the capturer
produces graphs, plans (``graphwrap.core.plans``) read them.
"""

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .tree import BATCHED, CONST

Tensor = torch.Tensor


class Serves(enum.Enum):
    """What serves a bucket's calls."""

    NOTHING = "not captured"  # not captured yet, or dropped for the memory budget
    CAPTURING = "capturing"  # a capture runs: calls meanwhile run eagerly
    GRAPH = "graph"
    EAGER = "eager"  # eager measured faster at capture
    FAILED = "failed"  # could not be captured (``reason``): calls run eagerly
    OVER_BUDGET = "over budget"  # left out for max_pool_bytes: a larger bucket serves its calls


def cut(o, kind: str, seq_dims: Tuple[int, ...], batch_dim: int, n: int, L: Optional[int]):
    """An output of a padded graph cut back to ``n`` rows and length ``L``."""
    if kind == CONST:
        return o
    if kind == BATCHED and o.shape[batch_dim] != n:
        o = o.narrow(batch_dim, 0, n)
    for d in seq_dims:
        if o.shape[d] != L:
            o = o.narrow(d, 0, L)
    return o


@dataclass(slots=True, eq=False)
class Graph:
    """One captured graph: the replay, its static inputs and outputs, and how to read them.

    Static inputs of a sequence bucket hold the pad value past each call's length: ``hi[i]``
    is the position from which input ``i`` is known to hold it in every row, so a call pads
    only what an earlier, longer call wrote.
    """

    graph: Any
    replay: Callable[[], None]
    size: int
    seq: Optional[int]
    roles: tuple
    batch_dim: int  # of the outputs
    static_inputs: List[Tensor]
    static_outputs: List[Any]
    kinds: List[str]
    seq_dims: List[Tuple[int, ...]]
    hi: List[int]
    run: Any = None  # the forward on the static inputs, as captured (for further captures of it)
    draws: bool = False  # whether the forward draws random numbers
    ring: Any = None  # owned-output slots (graphwrap.capture.slots)
    pool: Any = None  # the capture.cuda.Pool it was captured in: held, so its capture stream is not handed on
    copy_done: Any = None  # the pipeline's events: last copy into the inputs, last replay
    replay_done: Any = None
    host_in: Any = None  # gm(x)'s device buffers for larger host inputs (loops.staging.DeviceCopy)
    is_tensor: List[bool] = field(init=False)
    out_bytes: int = field(init=False)
    _views: Dict[Any, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.is_tensor = [k != CONST for k in self.kinds]
        self.out_bytes = sum(o.numel() * o.element_size() for o in self.static_outputs if isinstance(o, Tensor))

    def inputs_for(self, n: int, L: Optional[int]):
        """``(dsts, pads)`` for a call of ``n`` rows and length ``L``: the views its inputs are
        copied into, and per sequence input ``(index, view past L in every row, pad value)``."""
        key = ("in", n, L)
        got = self._views.get(key)
        if got is None:
            dsts, pads = [], []
            for i, (t, (bd, sd, pad)) in enumerate(zip(self.static_inputs, self.roles)):
                d = t if bd is None or n == self.size else t.narrow(bd, 0, n)
                if sd is not None:
                    assert L is not None  # a sequence input: every call of its key has a length
                    d = d.narrow(sd, 0, L)
                    pads.append((i, t.narrow(sd, L, t.shape[sd] - L), pad))
                dsts.append(d)
            got = self._views[key] = (dsts, pads)
        return got

    def outputs_for(self, n: int, L: Optional[int]) -> List[Any]:
        """The static outputs cut back to ``n`` rows and length ``L`` (views, cached)."""
        key = ("out", n, L)
        got = self._views.get(key)
        if got is None:
            got = self._views[key] = [cut(o, k, s, self.batch_dim, n, L)
                                      for o, k, s in zip(self.static_outputs, self.kinds, self.seq_dims)]
        return got

    def write(self, dsts, pads, leaves, L, non_blocking: bool = False):
        """Copy a call's inputs in, and the pad value where an earlier call left longer ones."""
        for d, s in zip(dsts, leaves):
            d.copy_(s, non_blocking=non_blocking)
        if pads:
            hi = self.hi
            for i, view, value in pads:
                if hi[i] > L:
                    view.fill_(value)
                hi[i] = L

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.static_inputs)


@dataclass(slots=True, eq=False)
class Bucket:
    """One (batch, sequence) bucket of a key: its graphs, what serves it, what it cost and served."""

    size: int
    seq: Optional[int] = None
    serves: Serves = Serves.NOTHING
    reason: Optional[str] = None  # why it runs eagerly (FAILED, OVER_BUDGET)
    graphs: List[Graph] = field(default_factory=list)  # [0] serves gm(...); others are leased to loops
    leased: set = field(default_factory=set)
    # counts of the loops that replay leased graphs; plans count their own calls
    replays: int = 0
    rows: int = 0
    padded_rows: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    eager_calls: int = 0
    capture_s: float = 0.0
    verify_s: float = 0.0
    compile_s: float = 0.0
    pool_bytes: int = 0
    pool_estimate: int = 0
    compiled: Optional[bool] = None  # runs Inductor's kernels (None: compile not asked)
    compiled_graphs: int = 0
    forward: Any = None  # the CompiledForward its graphs captured
    kernels: Optional[str] = None  # "shared" or "per-size"
    tuned: bool = False
    graph_us: Optional[float] = None
    eager_us: Optional[float] = None
    # A call whose every output slot the caller still holds: the graph's time with a clone of the
    # outputs, and whether one eager forward (which makes its own outputs) is faster than that.
    held_us: Optional[float] = None
    eager_when_held: bool = False
    eager_held_calls: int = 0
    shared_us: Optional[float] = None
    per_size_us: Optional[float] = None
    used: int = 0  # a clock tick of its last use, for the memory budget's evictions

    @property
    def point(self) -> Tuple[int, Optional[int]]:
        return self.size, self.seq

    @property
    def name(self) -> str:
        return str(self.size) if self.seq is None else f"{self.size}x{self.seq}"

    def replayed(self, n: int):
        """One replay of ``n`` real rows by a loop that holds a leased graph (no sequence
        length: those loops serve batches without one). ``tally``'s counts, added in place."""
        self.replays += 1
        self.rows += n
        self.padded_rows += self.size - n

    def absorb(self, c):
        """Add counts in the order of :data:`COUNTS` to this bucket's (a leased loop's replay
        calls this: plain additions, no loop over names)."""
        self.replays += c[0]
        self.rows += c[1]
        self.padded_rows += c[2]
        self.tokens += c[3]
        self.padded_tokens += c[4]
        self.eager_calls += c[5]


# What a bucket counts, in this order (stats, folded plans and leased loops add up the same way).
COUNTS = ("replays", "rows", "padded_rows", "tokens", "padded_tokens", "eager_calls")


def tally(b: "Bucket", calls: int, n: int, L: Optional[int], eager: bool, chosen: bool) -> list:
    """The counts (:data:`COUNTS`) of ``calls`` calls of ``n`` rows and length ``L`` served by
    bucket ``b``: replays with their padding, or eager calls (whose rows count as served rows
    where eager was chosen as faster)."""
    if eager:
        return [0, calls * n if chosen else 0, 0, 0, 0, calls]
    padded_tokens = calls * (b.size * b.seq - n * L) if L is not None and b.seq is not None else 0
    return [calls, calls * n, calls * (b.size - n), calls * n * L if L is not None else 0, padded_tokens, 0]


@dataclass(slots=True, eq=False)
class Key:
    """One input signature: its buckets, plans and output structure."""

    label: str
    spec: tuple
    roles: tuple
    device: torch.device
    autocast: Any
    seen_as: Optional[str]  # the signature as the captured forward sees it (None: eager for want of CUDA)
    single: Optional[tuple] = None  # (dtype, device index) for a lone tensor input without autocast
    has_seq: bool = False
    host: bool = False  # some input is on another device than the graphs (copied in)
    failed: Optional[str] = None  # why every call of this key runs eagerly
    exact: Optional[str] = None  # why lengths are not padded (graphs per exact length)
    kinds: Optional[List[str]] = None
    seq_dims: Optional[List[Tuple[int, ...]]] = None
    out_spec: Any = None
    buckets: Dict[Tuple[int, Optional[int]], Bucket] = field(default_factory=dict)
    plans: Dict[Tuple[int, Optional[int]], Any] = field(default_factory=dict)  # (n, L) -> Plan
    join: Any = None  # (kinds, seq_dims, out_spec) once a probe showed joining is safe
    join_refused: Optional[str] = None
    large: Dict[int, str] = field(default_factory=dict)  # chunks -> "graph" or "eager"
    large_eager: int = 0
    large_rows: int = 0
    staging: Any = None  # the direct call's device buffers for large host batches
    warming: bool = False  # a background capture runs: uncaptured buckets run eagerly
    warming_calls: int = 0
    eager_calls: int = 0
    # State inputs (a static cache, as state.StateRef): written in place by the graphs; they fix
    # the batch, so every call is one of its own shape
    states: tuple = ()
    fixed: bool = False

    def fail(self, reason: str):
        """Every later call of this key runs eagerly, for ``reason``."""
        self.failed = reason
        self.join = None
        self.join_refused = reason
        self.plans.clear()


@dataclass(slots=True)
class Member:
    """A request as joining sees it: requests of one key may go into one call."""

    key: Key
    leaves: List[Tensor]
    n: int
    L: Optional[int]


@dataclass(slots=True)
class Lease:
    """Graphs of one bucket, for one loop's sole use."""

    key: Key
    bucket: Bucket
    graphs: List[Graph]


class Store:
    """The graphs and their buffers, apart from the engine so a finalizer can release them: the
    engine sits in reference cycles (its parts point back at it) and waits for the garbage
    collector, while everything that holds a graph is here and goes when its module does."""

    def __init__(self, sync):
        self.keys: Dict[Any, Key] = {}
        self.device: Optional[torch.device] = None
        self.pool = None
        self.epoch = 0
        self.sync = sync
        self.fast: Dict[Any, Any] = {}  # input shape -> plan of gm(x) with one tensor (the engine's table)
        self.dropped: List[Graph] = []  # graphs evicted for the memory budget, freed after a device wait

    def detach(self):
        """Let go of every key, plan, graph and the pool (to be freed by :func:`drop`); a new epoch."""
        held = (self.keys, self.pool, self.device, self.dropped)
        self.keys, self.pool, self.device = {}, None, None  # the next key may be on another device
        self.dropped = []
        self.fast.clear()  # in place: the engine reads this very dict
        self.epoch += 1
        return held

    def release(self):
        drop(self.detach(), self.sync)


def drop(held, sync):
    """Free what a store let go of, once the device is done with its last replays (a replay may
    still be running: its memory must not be handed out before it ends)."""
    keys, pool, device, dropped = held
    if (keys or dropped) and device is not None and device.type == "cuda" and torch.cuda.is_initialized():
        sync(device)
    for ks in keys.values():
        ks.plans.clear()  # a plan points back at its key: the graphs would wait for the garbage collector
    keys.clear()
    dropped.clear()


def release_store(store: Store):
    try:
        store.release()
    except Exception:  # noqa: BLE001 - never raise from a finalizer (interpreter shutdown)
        pass
