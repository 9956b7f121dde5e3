"""Joining requests along the batch: which requests may share a call, the joined call, and
the outputs split back. The Batcher and ``pipeline(coalesce=True)`` use it: :class:`Joins` is
the engine's side (``engine.joins``: members, the joined call, what a call of so many rows
costs); the functions are pure torch and run and are tested on a CPU.

A model may have requests joined only once a probe showed it: the same requests, run one by
one and joined into one call, give each request the same rows (to the tolerance of different
batch sizes) and the same unbatched outputs. Graph verification catches most models that mix
rows of the batch, but not all (a sample of identical rows hides batch statistics); the probe
sees distinct rows from different requests. Requests of different lengths are padded to a
common length with each input's pad value; each gets its outputs cut back to its own length.
"""

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch

from .. import _compat
from ..core import stats as _stats
from ..core.compare import CROSS_SHAPE_TOL, compare_leaves, compare_tensors, tolerance
from ..core.plans import STALE
from ..core.reasons import NEEDS_GRAD, NO_CUDA, NOT_ON_CUDA, Eager, Kind, capture_reason, input_reason
from ..core.records import Key, Member, cut
from ..core.signature import describe_key
from ..core.tree import BATCHED, CONST, Tensor, classify_outputs, flatten_outputs, unflatten_inputs

logger = logging.getLogger("graphwrap")
NOT_BATCHED = "requests with inputs that are not batched are not joined"
WRITES_STATE = Eager("the forward writes module buffers: each request is a call of its own, as eager makes it",
                     Kind.MODULE)


def _alone(ks: Key) -> Optional[Eager]:
    """Why requests of ``ks`` are not joined (a probe showed it, or an input is not batched), or None."""
    return None if ks.join_refused is None else input_reason(ks.join_refused)


class Joins:
    """Join state and calls of one engine."""

    def __init__(self, engine):
        self.engine = engine
        self.eager_keys: Dict[Any, Key] = {}  # keys that run eagerly for want of CUDA

    def member(self, args, kwargs):
        """How a request may be joined with others (:class:`Member`: requests of one key may go
        into one call), or the :class:`~graphwrap.core.reasons.Eager` reason it runs alone. A signature that runs eagerly for
        want of CUDA gets a key of its own here, so joining works the same on a CPU."""
        eng = self.engine
        if eng.writes is not None:
            return WRITES_STATE
        if not kwargs and len(args) == 1 and type(args[0]) is Tensor:
            plan = eng.fast_plan(args[0])
            if plan is not None and plan.key.failed is None and plan.key.join_refused is None:
                return Member(plan.key, [args[0]], plan.n, plan.L)
        f = eng.facts(args, kwargs)
        if type(f) is Eager:
            return self._eager_member(args, kwargs) if f.kind is Kind.NO_GRAPHS else f
        with eng.lock:
            ks = eng.key(f)
        if type(ks) is Eager:
            return ks
        if ks.join_refused is None and any(r[0] is None for r in ks.roles):
            ks.join_refused = NOT_BATCHED
        if ks.failed is not None:
            return capture_reason(ks.failed)
        return _alone(ks) or Member(ks, f.leaves, f.n, f.L)

    def _eager_member(self, args, kwargs):
        eng = self.engine
        f = eng.decl.facts(args, kwargs, _compat.autocast_state("cpu"))
        if type(f) is Eager:
            return f
        if torch.is_grad_enabled() and any(t.requires_grad for t in f.leaves):
            return NEEDS_GRAD
        with eng.lock:
            ks = self.eager_keys.get(f.key)
            if ks is None:
                ks = self.eager_keys[f.key] = Key(describe_key(f.spec, f.meta, f.autocast), f.spec, f.roles,
                                                  f.leaves[0].device, f.autocast, None, has_seq=f.L is not None)
        if ks.join_refused is None and any(r[0] is None for r in ks.roles):
            ks.join_refused = NOT_BATCHED
        return _alone(ks) or Member(ks, f.leaves, f.n, f.L)

    def set_join(self, ks: Key, verdict):
        """Record what a join probe showed: ``(kinds, seq_dims, out_spec)``, or why not to join (an ``Eager``)."""
        if type(verdict) is Eager:
            ks.join_refused = verdict.reason
            logger.warning("requests of %s are not joined: %s", ks.label, verdict.reason)
        else:
            ks.join = verdict
            logger.info("requests of %s are joined along the batch", ks.label)

    def run_joined(self, ks: Key, leaves, n: int, L: Optional[int]):
        """A joined batch: its flat outputs, owned by the caller; None if the key failed (then
        every request must run alone)."""
        eng = self.engine
        args, kwargs = unflatten_inputs(ks.spec, leaves)
        if ks.seen_as is None:  # a key that runs eagerly for want of CUDA
            reason = NOT_ON_CUDA if _compat.cuda_available() else NO_CUDA
            return flatten_outputs(eng.eager(args, kwargs, reason))[0]
        for _ in range(3):
            plan = eng.plan_rows(ks, n, L, leaves)
            if ks.failed is not None:
                return None
            if plan.eager or plan.chunked:
                from .calls import call_plan
                return flatten_outputs(call_plan(eng, plan, leaves, args, kwargs))[0]
            outs = eng.run(plan, leaves)
            if outs is not STALE:
                return outs if eng.clone else [o.clone() if t else o for o, t in zip(outs, plan.is_tensor)]
        return None

    def max_rows(self, ks: Key, L: Optional[int]) -> int:
        """The most rows one joined call of ``ks`` at length ``L`` takes."""
        grid = self.engine.grid
        if not ks.has_seq or L is None:
            return grid.top(None)
        S = grid.seq_for(L, exact=ks.exact is not None)
        return grid.top(S) if S is not None else 1

    def cost(self, ks: Key, rows: int, L: Optional[int]) -> float:
        """What a call of ``rows`` rows at length ``L`` costs, in µs: its bucket's measured time,
        or an estimate from the key's other buckets (tokens at the rate of the slowest one)."""
        return _stats.cost(self.engine, ks, rows, L)


def pad_to(t: torch.Tensor, sd: int, length: int, pad) -> torch.Tensor:
    """``t`` padded along ``sd`` to ``length`` with ``pad`` (``t`` itself if it is that long)."""
    L = t.shape[sd]
    if L == length:
        return t
    shape = list(t.shape)
    shape[sd] = length
    out = t.new_full(shape, pad)
    out.narrow(sd, 0, L).copy_(t)
    return out


def join_leaves(columns: Sequence[Sequence[torch.Tensor]], roles, length: Optional[int] = None,
                out: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
    """One tensor per input: the requests' tensors padded along the sequence to ``length`` and
    concatenated along the batch (into ``out``'s tensors, if given)."""
    joined = []
    for j, (col, (bd, sd, pad)) in enumerate(zip(columns, roles)):
        if sd is not None and length is not None:
            col = [pad_to(t, sd, length, pad) for t in col]
        if out is not None:
            joined.append(torch.cat(list(col), bd, out=out[j]))
        else:
            joined.append(torch.cat(list(col), bd))
    return joined


def rows_differ(leaves: Sequence[torch.Tensor], roles) -> bool:
    """Whether some input has two different rows (else a probe on them proves nothing)."""
    for t, (bd, _, _) in zip(leaves, roles):
        first = t.narrow(bd, 0, 1)
        if not bool((t == first).all()):
            return True
    return False


def split_outputs(outs: Sequence[Any], kinds, seq_dims, spec, sizes: Sequence[int],
                  lengths: Sequence[Optional[int]], batch_dim: int) -> List[Any]:
    """Each request's output from the joined flat outputs: its rows of every batched output cut
    to its own length (views of the joined tensors, which nobody else writes), its own copy of
    every unbatched tensor, and the other values as they are; rebuilt with ``spec``."""
    parts: List[List[Any]] = [[] for _ in sizes]
    for o, kind, sdims in zip(outs, kinds, seq_dims):
        if kind == BATCHED:
            for p, piece, L in zip(parts, o.split(list(sizes), batch_dim), lengths):
                p.append(cut(piece, kind, sdims, batch_dim, piece.shape[batch_dim], L))
        elif kind == CONST:
            for p in parts:
                p.append(o)
        else:
            for i, (p, L) in enumerate(zip(parts, lengths)):
                w = cut(o, kind, sdims, batch_dim, 0, L)
                p.append(w if i == 0 and w is o else w.clone())
    return [spec.rebuild(p) for p in parts]


def join_verdict(joined: Sequence[Any], alone: Sequence[Any], sizes: Sequence[int], batch_dim: int,
                 lengths: Optional[Sequence[Optional[int]]] = None, length: Optional[int] = None,
                 seq_dims=None):
    """What a probe showed: ``(kinds, seq_dims, spec)`` if the joined flat outputs ``joined`` (at
    ``length``) hold each request's own output (``alone``, in order, of ``sizes`` rows and
    ``lengths``), the :class:`~graphwrap.core.reasons.Eager` reason requests of this model must
    not be joined, or None when these requests cannot tell (every length the same and the
    sequence dims unknown)."""
    lengths = list(lengths) if lengths is not None else [None] * len(sizes)
    flat = [flatten_outputs(a) for a in alone]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        return input_reason("the structure of the output changes with the batch size")
    if len(joined) != len(flat[0][0]):
        return input_reason("joined, the output has another structure than each request's own")
    ref = next((i for i, L in enumerate(lengths) if L != length), 0)
    kinds, found, problems = classify_outputs(list(joined), sum(sizes), flat[ref][0], sizes[ref], batch_dim, spec,
                                              length, lengths[ref])
    if problems:
        return input_reason(next(iter(problems.values())))
    if length is not None and lengths[ref] == length:
        if seq_dims is None:
            return None
        found = list(seq_dims)
    start = 0
    for i, ((leaves, _), n, L) in enumerate(zip(flat, sizes, lengths)):
        for j, (o, want, kind, sdims) in enumerate(zip(joined, leaves, kinds, found)):
            if kind == BATCHED:
                got = cut(o.narrow(batch_dim, start, n), kind, sdims, batch_dim, n, L)
                msg = compare_tensors(got, want, tolerance(want.dtype, CROSS_SHAPE_TOL))
            else:
                msg = compare_leaves([cut(o, kind, sdims, batch_dim, n, L)], [want], CROSS_SHAPE_TOL)
            if msg:
                return input_reason(f"joined along the batch, request {i}'s output {spec.describe(j)} differs from "
                                    f"its own call ({msg}); the model mixes rows of the batch")
        start += n
    return kinds, found, spec


def plan_groups(rows: Sequence[int], lengths: Sequence[Optional[int]], bucket: Callable[[int], int],
                max_rows: Callable[[Optional[int]], int], cost: Callable[[int, Optional[int]], float]) -> List[List[int]]:
    """Which requests go into which call, as lists of request indices (in arrival order within each).

    Requests without lengths go in arrival order, as many as fit in ``max_rows(None)``. With
    lengths, requests are first grouped by their sequence bucket (``bucket(L)``), each group cut
    at ``max_rows`` of its bucket; then, shortest first, a group is padded into the next longer
    one wherever ``cost`` (a call's cost, by rows and sequence bucket) says one call is cheaper
    than two.
    """
    order = list(range(len(rows)))
    if all(L is None for L in lengths):
        return _fill(order, rows, max_rows(None))
    by_bucket: Dict[int, List[int]] = {}  # (lengths: all or none are None)
    for i in order:
        by_bucket.setdefault(bucket(cast(int, lengths[i])), []).append(i)
    groups = []  # (S, indices)
    for S in sorted(by_bucket):
        groups += [(S, g) for g in _fill(by_bucket[S], rows, max_rows(S))]
    merged: List[Tuple[int, List[int]]] = []
    for S, idx in groups:
        if merged:
            S0, idx0 = merged[-1]
            total = sum(rows[i] for i in idx0 + idx)
            if total <= max_rows(S) and cost(total, S) <= cost(sum(rows[i] for i in idx0), S0) + \
                    cost(sum(rows[i] for i in idx), S):
                merged[-1] = (S, sorted(idx0 + idx))
                continue
        merged.append((S, idx))
    return [idx for _, idx in merged]


def _fill(order: Sequence[int], rows: Sequence[int], limit: int) -> List[List[int]]:
    """Consecutive runs of ``order`` of at most ``limit`` rows each (a request above it alone)."""
    out: List[List[int]] = []
    cur: List[int] = []
    n = 0
    for i in order:
        if cur and n + rows[i] > limit:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += rows[i]
    if cur:
        out.append(cur)
    return out


def probe(engine, ks, leaves_list, sizes: Sequence[int], lengths: Sequence[Optional[int]], alone: Sequence[Any],
          joined=None) -> bool:
    """Join requests that were each served alone (``alone``: their outputs) into one call and
    record on the key whether each got its own output back; whether the joined call ran.
    ``joined``: the joined inputs, if the caller made them (on the device, say)."""
    L = max(cast(Sequence[int], lengths)) if ks.has_seq else None  # every request has a length
    if joined is None:
        joined = join_leaves(list(zip(*leaves_list)), ks.roles, L)
    if not rows_differ(joined, ks.roles):
        return False  # identical rows show nothing: probe again with other requests
    try:
        outs = engine.joins.run_joined(ks, joined, sum(sizes), L)
    except Exception as e:  # noqa: BLE001 - the module cannot take them joined
        engine.joins.set_join(ks, Eager(f"joined requests make the module raise: {type(e).__name__}: {e}", Kind.MODULE))
        return False
    if outs is None:
        return False
    verdict = join_verdict(outs, alone, sizes, engine.batch_dim, lengths, L, ks.seq_dims)
    if verdict is not None:
        engine.joins.set_join(ks, verdict)
    return True
