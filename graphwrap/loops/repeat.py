"""One call repeated with a few of its tensors replaced: a decode step, whose inputs the loop
keeps from step to step (the cache, the encoder's output, a mask it moves on in place) but for
the new tokens.

The direct call (:func:`~graphwrap.loops.calls.call_general`) flattens every input each call,
walks the module and the state, builds the call's facts, finds its plan and rebuilds the output
structure, every step: for an encoder-decoder's step, whose inputs hold the encoder's output and
a cache of two parts, the larger part of the engine's host time. :class:`Repeat` does all that for the
first call and keeps the facts and the plan. A later call is checked for what could have
changed since, and replays the kept plan with the new tensors:

- the module: the watch's per-call check (as ``gm(x)``'s one-tensor path does), not in
  training mode, no global hooks, the same autocast;
- the inputs: the same dict, holding the same objects, the replaced tensors of the same shape,
  dtype and device, needing no grad;
- the state: its tensors at the addresses the plan's key was made with;
- the plan: of the engine's epoch, not dropped since (``plans.fold`` marks what it drops).

Anything else goes the direct call's way, and is kept again if it replays. The output is the
one field the loop reads, a view of the graph's static output, valid until the next replay.
"""

from typing import List, Optional, Tuple

import torch

from .. import _compat
from ..core.plans import STALE
from ..core.reasons import Eager
from ..core.signature import state_refs
from ..core.state import state_tensors
from ..core.watch import GLOBAL_TABLES
from .calls import call_general, call_plan

Tensor = torch.Tensor
_GLOBAL_PRE, _GLOBAL_POST = GLOBAL_TABLES
grad_on = torch.is_grad_enabled


def field_of(out, name: str):
    """``out.name`` of a model's output (a ModelOutput, a dict, an object)."""
    if isinstance(out, dict):
        return out[name]
    return getattr(out, name)


class _Kept:
    """What the first call found, and what a later call must match to replay it."""

    __slots__ = ("kw", "items", "slots", "shapes", "leaves", "plan", "out", "states", "autocast")

    def __init__(self, kw: dict, replaced: Tuple[str, ...], f, plan, out: int):
        self.kw, self.plan, self.out, self.autocast = kw, plan, out, f.autocast
        self.items = [(k, v) for k, v in kw.items() if k not in replaced]
        self.leaves: List[Tensor] = list(f.leaves)
        self.slots = [(i, name) for name in replaced if name in kw
                      for i, t in enumerate(self.leaves) if t is kw[name]]
        self.shapes = [(t.shape, t.dtype, t.device) for t in (self.leaves[i] for i, _ in self.slots)]
        self.states = [(ref.obj, ref.ptrs) for ref in state_refs(f.spec)]

    def holds(self, kw: dict, engine) -> bool:
        if kw is not self.kw or len(kw) != len(self.items) + len(self.slots):
            return False
        for k, v in self.items:
            if kw.get(k) is not v:
                return False
        for (_, name), (shape, dtype, device) in zip(self.slots, self.shapes):
            t = kw.get(name)
            if type(t) is not Tensor or t.shape != shape or t.dtype is not dtype or t.device != device:
                return False
            if t.requires_grad and grad_on():
                return False
        if (engine.module.training or _GLOBAL_PRE or _GLOBAL_POST or not engine.watch.current()
                or _compat.autocast_state("cuda") != self.autocast):
            return False
        return all(tuple(t.data_ptr() for t in state_tensors(obj)) == ptrs for obj, ptrs in self.states)


class Repeat:
    """``repeat(kw)``: ``engine.call((), kw)``'s output field ``field``, for a loop that calls
    with the same dict ``kw`` each time, only the tensors named in ``replaced`` replaced."""

    def __init__(self, engine, replaced: Tuple[str, ...], field: str):
        self.engine, self.replaced, self.field = engine, replaced, field
        self.kept: Optional[_Kept] = None
        self.calls = 0  # calls that replayed the kept plan

    def __call__(self, kw: dict):
        kept = self.kept
        if kept is not None and kept.holds(kw, self.engine):
            leaves = kept.leaves
            for i, name in kept.slots:
                leaves[i] = kw[name]
            outs = self.engine.run(kept.plan, leaves, clone=False)
            if outs is not STALE:
                self.calls += 1
                return outs[kept.out]
        self.kept = None
        return self._direct(kw)

    def _direct(self, kw: dict):
        engine = self.engine
        f = engine.facts((), kw)
        if type(f) is Eager:
            return field_of(engine.eager((), kw, f), self.field)
        plan = engine.plan(f)
        out = self._out_index(plan)
        if plan.eager or plan.chunked or not f.state or out is None or engine.adaptive is not None:
            return field_of(call_plan(engine, plan, f.leaves, (), kw), self.field)
        outs = engine.run(plan, f.leaves, clone=False)
        if outs is STALE:
            return field_of(call_general(engine, (), kw), self.field)
        self.kept = _Kept(kw, self.replaced, f, plan, out)
        return outs[out]

    def _out_index(self, plan) -> Optional[int]:
        spec = plan.key.out_spec if plan.key is not None else None
        if spec is None:
            return None
        paths = {f"out[{self.field!r}]", f"out.{self.field}"}
        return next((i for i in range(spec.num_leaves) if spec.describe(i) in paths), None)

