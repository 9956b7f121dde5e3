import pytest

from graphwrap import BucketTable, GraphwrapError, default_buckets


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
