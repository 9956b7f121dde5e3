"""Property-based tests of bucketing, chunking, padding and unpadding on random shapes."""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from graphwrap import BucketTable, default_buckets  # noqa: E402
from graphwrap.capture.checks import shape_leaf, tile_rows  # noqa: E402
from graphwrap.core.records import Graph  # noqa: E402
from graphwrap.core.tree import (  # noqa: E402
    BATCHED,
    WHOLE,
    flatten_inputs,
    flatten_outputs,
    unflatten_inputs,
)

bucket_lists = st.lists(st.integers(1, 300), min_size=1, max_size=12)


@given(bucket_lists, st.integers(1, 2000))
def test_chunks_cover_every_row_once(buckets, n):
    t = BucketTable(buckets)
    pieces = t.chunks(n)
    covered = []
    for start, rows, b in pieces:
        assert 1 <= rows <= b and b in t.buckets and b == t.bucket_for(rows)
        covered.extend(range(start, start + rows))
    assert covered == list(range(n))


@given(st.integers(1, 5000))
def test_default_buckets_hold_every_size(top):
    t = BucketTable(max_batch_size=top)
    assert list(t.buckets) == default_buckets(top)
    for n in {1, top, max(1, top // 3), max(1, top - 1)}:
        assert n <= t.bucket_for(n) <= top


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(0, 2), st.integers(1, 9), st.integers(0, 8), st.data())
def test_pad_then_unpad_gives_back_the_rows(ndim_extra, bd_seed, rows, extra, data):
    bd = bd_seed % (ndim_extra + 1)
    size = rows + extra
    shape = [data.draw(st.integers(1, 4)) for _ in range(ndim_extra + 1)]
    shape[bd] = rows
    x = torch.randn(*shape)
    padded = tile_rows(x, rows, size, bd)
    assert padded.shape[bd] == size
    assert torch.equal(padded.narrow(bd, 0, rows), x)
    for i in range(size):  # every padding row is a copy of a real row
        assert torch.equal(padded.select(bd, i), x.select(bd, i % rows))
    g = Graph(None, None, size, None, ((bd, None, 0),), bd, [padded], [padded, torch.ones(3)], [BATCHED, WHOLE],
              [(), ()], [0])
    got = g.outputs_for(rows, None)
    assert torch.equal(got[0], x) and got[1].shape == (3,)
    assert g.inputs_for(rows, None)[0][0].shape == x.shape


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(0, 4), st.integers(1, 12), st.integers(0, 9), st.data())
def test_sequence_padding_writes_only_what_a_longer_call_left(rows, extra_rows, L, extra_len, data):
    # Calls of random lengths into one padded buffer: after each, positions past its length
    # hold the pad value in every row, and its own positions hold its values.
    size, S = rows + extra_rows, L + extra_len
    static = shape_leaf(torch.randint(1, 50, (rows, L)), (0, 1, -7), size, S)
    g = Graph(None, None, size, S, ((0, 1, -7),), 0, [static], [], [], [], [L])
    for _ in range(4):
        n, length = data.draw(st.integers(1, size)), data.draw(st.integers(1, S))
        x = torch.randint(1, 50, (n, length))
        dsts, pads = g.inputs_for(n, length)
        g.write(dsts, pads, [x], length)
        assert torch.equal(static[:n, :length], x)
        assert bool((static[:, length:] == -7).all())


leaf = st.one_of(st.integers(), st.booleans(), st.text(max_size=3), st.none(),
                 st.floats(allow_nan=True), st.just("T"))
trees = st.recursive(leaf, lambda c: st.one_of(st.lists(c, max_size=3), st.tuples(c, c),
                                               st.dictionaries(st.text(max_size=2), c, max_size=3)), max_leaves=12)


def _materialise(obj):
    if obj == "T":
        return torch.randn(2, 3)
    if isinstance(obj, list):
        return [_materialise(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_materialise(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _materialise(v) for k, v in obj.items()}
    return obj


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, float) and a != a:
        return b != b
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=100, deadline=None)
@given(trees, trees)
def test_inputs_flatten_and_rebuild(args_tree, kw_tree):
    args = (_materialise(args_tree),)
    kwargs = {"k": _materialise(kw_tree)}
    leaves, spec = flatten_inputs(args, kwargs)
    hash(spec)
    a2, k2 = unflatten_inputs(spec, leaves)
    assert _same(a2, args) and _same(k2, kwargs)
    assert spec == flatten_inputs(args, kwargs)[1], "same call, same key"
    out = _materialise(args_tree)
    ol, ospec = flatten_outputs(out)
    assert _same(ospec.rebuild(ol), out)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.integers(1, 40), st.integers(1, 30), min_size=1, max_size=7), st.integers(1, 5))
def test_fit_buckets_is_optimal(hist, k):
    import itertools

    from graphwrap import fit_buckets, padded_rows

    chosen = fit_buckets(hist, k)
    sizes = sorted(hist)
    assert len(chosen) <= k and chosen[-1] == sizes[-1] and set(chosen) <= set(sizes)
    best = min(
        padded_rows(list(rest) + [sizes[-1]], hist)
        for r in range(k)
        for rest in itertools.combinations(sizes[:-1], r)
    )
    assert padded_rows(chosen, hist) == best
