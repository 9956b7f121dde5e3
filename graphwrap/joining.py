"""Joining requests along the batch and splitting the outputs back, and the check that joining
is safe for a model. Pure torch: runs and is tested on a CPU.

A model may have requests joined only once a probe showed it: the same requests, run one by
one and joined into one call, give each request the same rows (to the tolerance of different
batch sizes) and the same unbatched outputs. Graph verification catches most models that mix
rows of the batch, but not all (a sample of identical rows hides batch statistics); the probe
sees distinct rows from different requests.
"""

from typing import Any, List, Sequence

import torch

from .tree import BATCHED, CONST, OutputSpec, classify_outputs, flatten_outputs
from .verify import CROSS_SHAPE_TOL, compare_leaves, compare_tensors, tolerance


def join_leaves(columns: Sequence[Sequence[torch.Tensor]], batch_dim: int) -> List[torch.Tensor]:
    """One tensor per input position: the requests' tensors concatenated along ``batch_dim``."""
    return [torch.cat(list(col), batch_dim) for col in columns]


def rows_differ(leaves: Sequence[torch.Tensor], batch_dim: int) -> bool:
    """Whether some input has two different rows (else a probe on them proves nothing)."""
    for t in leaves:
        first = t.narrow(batch_dim, 0, 1)
        if not bool((t == first).all()):
            return True
    return False


def split_outputs(outs: Sequence[Any], kinds: Sequence[str], spec: OutputSpec, sizes: Sequence[int],
                  batch_dim: int) -> List[Any]:
    """Each request's output from the joined flat outputs: its rows of every batched output (views
    of the joined tensors, which nobody else writes), its own copy of every unbatched tensor, and
    the other values as they are; rebuilt with ``spec``."""
    parts: List[List[Any]] = [[] for _ in sizes]
    for o, kind in zip(outs, kinds):
        if kind == BATCHED:
            for p, piece in zip(parts, o.split(list(sizes), batch_dim)):
                p.append(piece)
        elif kind == CONST:
            for p in parts:
                p.append(o)
        else:
            for i, p in enumerate(parts):
                p.append(o if i == 0 else o.clone())
    return [spec.rebuild(p) for p in parts]


def join_verdict(joined: Sequence[Any], alone: Sequence[Any], sizes: Sequence[int], batch_dim: int):
    """What a probe showed: ``(kinds, spec)`` if the joined flat outputs ``joined`` hold each
    request's own output (``alone``, in order, of ``sizes`` rows), else a string saying why
    requests of this model must not be joined."""
    flat = [flatten_outputs(a) for a in alone]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        return "the structure of the output changes with the batch size"
    if len(joined) != len(flat[0][0]):
        return "joined, the output has another structure than each request's own"
    total = sum(sizes)
    kinds, problems = classify_outputs(list(joined), total, flat[0][0], sizes[0], batch_dim, spec)
    if problems:
        return next(iter(problems.values()))
    start = 0
    for i, ((leaves, _), n) in enumerate(zip(flat, sizes)):
        for j, (o, want, kind) in enumerate(zip(joined, leaves, kinds)):
            where = f"output {spec.describe(j)}"
            if kind == BATCHED:
                msg = compare_tensors(o.narrow(batch_dim, start, n), want, tolerance(want.dtype, CROSS_SHAPE_TOL))
            else:
                msg = compare_leaves([o], [want], CROSS_SHAPE_TOL)
            if msg:
                return (f"joined along the batch, request {i}'s {where} differs from its own call ({msg}); "
                        "the model mixes rows of the batch")
        start += n
    return kinds, spec
