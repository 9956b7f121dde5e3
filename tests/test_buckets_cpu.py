import pytest

import graphwrap
from graphwrap import (
    BucketTable,
    GraphwrapError,
    default_buckets,
    fit_buckets,
    padded_rows,
)


def test_default_buckets_dense_then_sparse():
    b = default_buckets(256)
    assert b[:5] == [1, 2, 4, 8, 16]
    assert b[-1] == 256
    assert b == sorted(set(b))
    steps = [y - x for x, y in zip(b, b[1:])]
    assert steps == sorted(steps), "steps never shrink as batches grow"
    # above 64 rows, padding wastes at most an eighth of a bucket
    for x, y in zip(b, b[1:]):
        if x >= 64:
            assert (y - x) / y <= 0.125


@pytest.mark.parametrize("top", [1, 2, 3, 5, 8, 9, 100, 1000, 1280])
def test_default_buckets_end_at_max(top):
    b = default_buckets(top)
    assert b[-1] == top and all(0 < x <= top for x in b) and b == sorted(set(b))


def test_lookup_every_size():
    t = BucketTable([3, 1, 8, 8, 20])
    assert t.buckets == (1, 3, 8, 20)
    for n in range(1, 21):
        b = t.bucket_for(n)
        assert b >= n and b in t.buckets
        assert all(x < n for x in t.buckets if x < b), "smallest bucket that fits"


def test_chunks_cover_rows_in_order():
    t = BucketTable([1, 2, 4, 8])
    for n in range(1, 40):
        ch = t.chunks(n)
        assert sum(r for _, r, _ in ch) == n
        start = 0
        for s, r, b in ch:
            assert s == start and r <= b and b == t.bucket_for(r)
            start += r
        assert all(r == 8 for _, r, _ in ch[:-1])


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"buckets": []}, "empty"),
        ({"buckets": [0, 4]}, "positive ints"),
        ({"buckets": [2.5]}, "positive ints"),
        ({"buckets": [1, 8], "max_batch_size": 16}, "max_batch_size=16 does not match"),
        ({"max_batch_size": 0}, "positive int"),
    ],
)
def test_bad_buckets_say_why(kwargs, words):
    with pytest.raises(GraphwrapError, match=words):
        BucketTable(**kwargs)


def test_exact_buckets_one_per_size():
    assert graphwrap.exact_buckets(5) == [1, 2, 3, 4, 5]
    t = BucketTable("exact", max_batch_size=12)
    assert all(t.bucket_for(n) == n for n in range(1, 13))
    assert t.chunks(30) == [(0, 12, 12), (12, 12, 12), (24, 6, 6)]


def test_unknown_policy_names_the_choices():
    with pytest.raises(GraphwrapError, match='"exact"'):
        BucketTable("powers-of-two")
    with pytest.raises(GraphwrapError, match="GraphedModule only"):
        BucketTable(graphwrap.Adaptive(k=2, histogram={1: 1}))


def test_fit_buckets_known_answer():
    # Two clusters: one bucket at the top of each wastes 1*2 + 2*1 = 4 rows.
    hist = {1: 10, 2: 10, 3: 10, 30: 5, 31: 5, 32: 5}
    assert fit_buckets(hist, 2) == [3, 32]
    assert padded_rows([3, 32], hist) == 10 * 2 + 10 * 1 + 5 * 2 + 5 * 1
    assert fit_buckets(hist, 6) == [1, 2, 3, 30, 31, 32]
    assert fit_buckets(hist, 100) == [1, 2, 3, 30, 31, 32]
    assert fit_buckets(hist, 1) == [32]
    # A rare large size does not pull a bucket away from the common small ones.
    assert fit_buckets({1: 1000, 2: 1000, 64: 1}, 2) == [2, 64]


def test_fit_buckets_rejects_bad_input():
    for bad in ({}, {0: 3}, {2: -1}, {1.5: 2}, [1, 2], {3: 0}):
        with pytest.raises(GraphwrapError):
            fit_buckets(bad, 2)
    with pytest.raises(GraphwrapError):
        fit_buckets({1: 1}, 0)


def test_padded_rows_counts_chunks():
    assert padded_rows([4, 8], {3: 2, 8: 1, 9: 1}) == 2 * 1 + 0 + 3
    assert padded_rows(graphwrap.exact_buckets(16), {n: 1 for n in range(1, 17)}) == 0


def test_adaptive_counts_then_fits():
    a = graphwrap.Adaptive(k=2, warmup_calls=6)
    sizes = [1, 1, 2, 16, 15, 1]
    got = [a.observe(n) for n in sizes]
    assert got[:5] == [None] * 5 and got[5] == fit_buckets({1: 3, 2: 1, 15: 1, 16: 1}, 2)
    assert a.buckets == got[5] and a.observe(3) is None  # fitted once
    given = graphwrap.Adaptive(k=3, histogram={5: 2, 9: 1})
    assert given.buckets == [5, 9]
    with pytest.raises(GraphwrapError):
        graphwrap.Adaptive(k=0)
