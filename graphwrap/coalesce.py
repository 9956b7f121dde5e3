"""``pipeline(coalesce=True)``: consecutive small items joined into one replay, one output per item.

The loop reads items ahead while they share an input signature and their rows fit in the
largest bucket (at most one item more than it joins is held back), joins them along the batch
and hands the joined item to the pipeline; each output it yields is split back into one output
per item, in order. Items of a signature are joined only once a probe showed that joining gives
each item what it gets alone (see :mod:`graphwrap.joining`); the others go one by one.
"""

import collections
from typing import Any, Iterable, Iterator

import torch

from .calls import call
from .joining import join_verdict, rows_differ, split_outputs
from .pipeline import Inputs, as_call, run_pipeline
from .tree import Tensor, flatten_outputs, map_tensors, unflatten_inputs


def _groups(engine, items):
    """Lists of ``(args, kwargs, info)`` for consecutive items that may go into one call."""
    limit = engine.table.max
    group, rows, key = [], 0, None
    for item in items:
        args, kwargs = ((item,), {}) if type(item) is Tensor else as_call(item)
        info = engine.join_info(args, kwargs)
        if isinstance(info, str) or info[2] > limit:
            if group:
                yield group
            yield [(args, kwargs, None)]
            group, rows, key = [], 0, None
            continue
        if group and (info[0] != key or rows + info[2] > limit):
            yield group
            group, rows = [], 0
        group.append((args, kwargs, info))
        rows += info[2]
        key = info[0]
    if group:
        yield group


def _join(group, batch_dim):
    columns = list(zip(*(info[1] for _, _, info in group)))
    out = []
    for col in columns:
        if not col[0].is_cuda and col[0].is_pinned() and torch.cuda.is_available():
            shape = list(col[0].shape)
            shape[batch_dim] = sum(t.shape[batch_dim] for t in col)
            out.append(torch.cat(list(col), batch_dim, out=torch.empty(shape, dtype=col[0].dtype, pin_memory=True)))
        else:
            out.append(torch.cat(list(col), batch_dim))
    return out


def _probe(engine, group) -> None:
    """Run the group's items alone and joined; record whether joining gives each its own."""
    ks = group[0][2][3]
    leaves = _join(group, engine.batch_dim)
    if not rows_differ(leaves, engine.batch_dim):
        return
    sizes = [info[2] for _, _, info in group]
    try:
        # outputs="view": each alone output is overwritten by the next call unless copied
        alone = [call(engine, a, k) if engine.clone else map_tensors(torch.clone, call(engine, a, k))
                 for a, k, _ in group]
        joined = engine.run_joined(ks, leaves, sum(sizes))
    except Exception as e:  # noqa: BLE001 - joined or alone, the module raised: do not join
        engine.set_join(ks, f"a probe of joined items made the module raise: {type(e).__name__}: {e}")
        return
    if joined is not None:
        engine.set_join(ks, join_verdict(joined, alone, sizes, engine.batch_dim))


def run_coalesced(engine, batches: Iterable[Any], to_host: bool = False) -> Iterator[Any]:
    plan = collections.deque()  # per pipeline item: None (one item as it is) or (key, sizes)

    def items():
        for group in _groups(engine, iter(batches)):
            ks = group[0][2][3] if group[0][2] is not None else None
            if len(group) > 1 and ks.join is None and ks.join_refused is None and ks.failed is None:
                _probe(engine, group)
            if len(group) > 1 and ks.join is not None and ks.failed is None:
                plan.append((ks, [info[2] for _, _, info in group]))
                args, kwargs = unflatten_inputs(ks.in_spec, _join(group, engine.batch_dim))
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
        ks, sizes = how
        kinds, spec = ks.join
        yield from split_outputs(flatten_outputs(out)[0], kinds, spec, sizes, engine.batch_dim)

