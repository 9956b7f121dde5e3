"""The engine's side of joining requests: which requests may share a call, the joined call itself,
and what a call of so many rows costs. The Batcher and ``pipeline(coalesce=True)`` use it as
``engine.joins``; how requests are joined and split is :mod:`graphwrap.joining`.
"""

import logging
from typing import Any, Dict, Optional

from . import _compat
from . import stats as _stats
from .backend import CPU_REASONS
from .plans import STALE
from .records import Key, Member
from .signature import describe_key
from .tree import Tensor, flatten_outputs, unflatten_inputs

logger = logging.getLogger("graphwrap")
NOT_BATCHED = "requests with inputs that are not batched are not joined"
WRITES_STATE = "the forward writes module buffers: each request is a call of its own, as eager makes it"


class Joins:
    """Join state and calls of one engine."""

    def __init__(self, engine):
        self.engine = engine
        self.eager_keys: Dict[Any, Key] = {}  # keys that run eagerly for want of CUDA

    def member(self, args, kwargs):
        """How a request may be joined with others (:class:`Member`: requests of one key may go
        into one call), or a string saying why it runs alone. A signature that runs eagerly for
        want of CUDA gets a key of its own here, so joining works the same on a CPU."""
        eng = self.engine
        if eng.writes is not None:
            return WRITES_STATE
        if not kwargs and len(args) == 1 and type(args[0]) is Tensor:
            plan = eng.fast_plan(args[0])
            if plan is not None and plan.key.failed is None and plan.key.join_refused is None:
                return Member(plan.key, [args[0]], plan.n, plan.L)
        f = eng.facts(args, kwargs)
        if type(f) is str:
            return self._eager_member(args, kwargs) if f in CPU_REASONS else f
        with eng.lock:
            ks = eng.store.keys.get(f.key) or eng.key_for(f)
        if type(ks) is str:
            return ks
        if ks.join_refused is None and any(r[0] is None for r in ks.roles):
            ks.join_refused = NOT_BATCHED
        return ks.failed or ks.join_refused or Member(ks, f.leaves, f.n, f.L)

    def _eager_member(self, args, kwargs):
        from .engine import GRAD_REASONS, grad_on

        eng = self.engine
        f = eng.decl.facts(args, kwargs, _compat.autocast_state("cpu"))
        if type(f) is str:
            return f
        if grad_on() and any(t.requires_grad for t in f.leaves):
            return GRAD_REASONS[1]
        with eng.lock:
            ks = self.eager_keys.get(f.key)
            if ks is None:
                ks = self.eager_keys[f.key] = Key(describe_key(f.spec, f.meta, f.autocast), f.spec, f.roles,
                                                  f.leaves[0].device, f.autocast, None, has_seq=f.L is not None)
        if any(r[0] is None for r in ks.roles):
            return NOT_BATCHED
        return ks.join_refused or Member(ks, f.leaves, f.n, f.L)

    def set_join(self, ks: Key, verdict):
        """Record what a join probe showed: ``(kinds, seq_dims, out_spec)``, or why not to join."""
        if isinstance(verdict, str):
            ks.join_refused = verdict
            logger.warning("graphwrap: requests of %s are not joined: %s", ks.label, verdict)
        else:
            ks.join = verdict
            logger.info("graphwrap: requests of %s are joined along the batch", ks.label)

    def run_joined(self, ks: Key, leaves, n: int, L: Optional[int]):
        """A joined batch: its flat outputs, owned by the caller; None if the key failed (then
        every request must run alone)."""
        eng = self.engine
        args, kwargs = unflatten_inputs(ks.spec, leaves)
        if ks.seen_as is None:  # a key that runs eagerly for want of CUDA
            reason = CPU_REASONS[1] if _compat.cuda_available() else CPU_REASONS[0]
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
