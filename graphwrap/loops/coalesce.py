"""``pipeline(coalesce=True)``: consecutive small items joined into one replay, one output per item.

The loop reads items ahead while they share an input signature and their rows fit in the
largest bucket (at most one item more than it joins is held back), joins them along the batch
(padded to the longest, for inputs with a sequence dimension) and hands the joined item to the
pipeline; each output it yields is split back into one output per item, in order. Items of a
signature are joined only once a probe showed that joining gives each item what it gets alone
(see :mod:`graphwrap.loops.joins`); the others go one by one.
"""

import collections
from typing import Any, Deque, Iterable, Iterator, List

import torch

from ..core.reasons import Eager, Kind
from ..core.records import Member
from ..core.tree import Tensor, flatten_outputs, map_tensors, unflatten_inputs
from .joins import join_leaves, probe, split_outputs
from .pipeline import Inputs, as_call, run_pipeline


def _groups(engine, items):
    """Lists of ``(args, kwargs, member)`` for consecutive items that may go into one call."""
    group: List[Any] = []
    rows, key, longest = 0, None, None
    for item in items:
        args, kwargs = ((item,), {}) if type(item) is Tensor else as_call(item)
        m = engine.joins.member(args, kwargs)
        limit = engine.joins.max_rows(m.key, m.L) if type(m) is Member else 0  # else an Eager reason: alone
        if limit == 0 or m.n > limit:
            if group:
                yield group
            yield [(args, kwargs, None)]
            group, rows, key = [], 0, None
            continue
        if group and (m.key is not key or rows + m.n > min(limit, engine.joins.max_rows(key, longest))):
            yield group
            group, rows = [], 0
        if not group:
            longest = m.L
        longest = m.L if m.L is None else max(longest, m.L)
        group.append((args, kwargs, m))
        rows += m.n
        key = m.key
    if group:
        yield group


def _join(engine, group):
    ks = group[0][2].key
    L = max(m.L for _, _, m in group) if ks.has_seq else None
    columns = list(zip(*(m.leaves for _, _, m in group)))
    pinned = [not c[0].is_cuda and c[0].is_pinned() and torch.cuda.is_available() for c in columns]
    joined = join_leaves(columns, ks.roles, L)
    return [t.pin_memory() if p else t for t, p in zip(joined, pinned)], L


def _probe(engine, group) -> None:
    """Run the group's items alone and joined; record whether joining gives each its own."""
    ks = group[0][2].key
    # outputs="view": each alone output is overwritten by the next call unless copied
    alone = [engine.call(a, k) if engine.clone else map_tensors(torch.clone, engine.call(a, k))
             for a, k, _ in group]
    try:
        probe(engine, ks, [m.leaves for _, _, m in group], [m.n for _, _, m in group],
              [m.L for _, _, m in group], alone)
    except Exception as e:  # noqa: BLE001 - joined or alone, the module raised: do not join
        engine.joins.set_join(ks, Eager(f"a probe of joined items made the module raise: {type(e).__name__}: {e}",
                                        Kind.MODULE))


def run_coalesced(engine, batches: Iterable[Any], to_host: bool = False) -> Iterator[Any]:
    plan: Deque[Any] = collections.deque()  # per pipeline item: None (one item as it is) or (key, sizes, lengths)

    def items():
        for group in _groups(engine, iter(batches)):
            ks = group[0][2].key if group[0][2] is not None else None
            if ks is not None and len(group) > 1 and ks.join is None and ks.join_refused is None and ks.failed is None:
                _probe(engine, group)
            if ks is not None and len(group) > 1 and ks.join is not None and ks.failed is None:
                plan.append((ks, [m.n for _, _, m in group], [m.L for _, _, m in group]))
                joined, _ = _join(engine, group)
                args, kwargs = unflatten_inputs(ks.spec, joined)
                yield Inputs(*args, **kwargs)
            else:
                for args, kwargs, _ in group:
                    plan.append(None)
                    yield Inputs(*args, **kwargs)

    for out in run_pipeline(engine, items(), to_host=to_host):
        how = plan.popleft()
        if how is None:
            yield out
            continue
        ks, sizes, lengths = how
        kinds, seq_dims, spec = ks.join
        yield from split_outputs(flatten_outputs(out)[0], kinds, seq_dims, spec, sizes, lengths, engine.batch_dim)
