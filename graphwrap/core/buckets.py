"""Batch-size buckets: which captured size serves a batch, and how an oversized batch is split."""

from typing import Dict, List, Literal, Mapping, Optional, Sequence, Tuple, Union

from ..errors import GraphwrapError

DEFAULT_MAX_BATCH_SIZE = 256


def default_buckets(max_batch_size: int = DEFAULT_MAX_BATCH_SIZE) -> List[int]:
    """Buckets dense where batches are small and sparse where they are large.

    1, 2, 4, 8, then steps of 8 up to 128, then steps of one eighth of the power of two
    below (16 up to 256, 32 up to 512, ...), so a padded batch wastes at most 12.5% of its
    rows above 64, and ``max_batch_size`` itself is always a bucket.
    """
    if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 1:
        raise GraphwrapError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
    out = [b for b in (1, 2, 4) if b < max_batch_size]
    b = 8
    while b < max_batch_size:
        out.append(b)
        b += max(8, 1 << (b.bit_length() - 4))
    out.append(max_batch_size)
    return out


def exact_buckets(max_batch_size: int = DEFAULT_MAX_BATCH_SIZE) -> List[int]:
    """One bucket per batch size from 1 to ``max_batch_size``: no padded rows at all."""
    default_buckets(max_batch_size)  # validates
    return list(range(1, max_batch_size + 1))


def fit_buckets(histogram: Mapping[int, int], k: int) -> List[int]:
    """At most ``k`` buckets that minimise the padded rows over ``histogram`` (batch size -> calls).

    The largest size seen is always a bucket, so every batch of the histogram fits. The choice
    is exact (dynamic programming over the distinct sizes; the best buckets are always sizes
    that occur): O(k * m^2) for m distinct sizes.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise GraphwrapError(f"k must be a positive int, got {k!r}")
    hist = _check_histogram(histogram)
    sizes = sorted(hist)
    m = len(sizes)
    if m <= k:
        return sizes
    # pc[i]: calls of sizes[:i]; pr[i]: rows of sizes[:i]. Serving sizes[j:i] with bucket
    # sizes[i-1] pads  sizes[i-1] * calls - rows  rows.
    pc, pr = [0], [0]
    for s in sizes:
        pc.append(pc[-1] + hist[s])
        pr.append(pr[-1] + hist[s] * s)

    def waste(j, i):
        return sizes[i - 1] * (pc[i] - pc[j]) - (pr[i] - pr[j])

    inf = float("inf")
    # best[i]: least padding serving sizes[:i] with the buckets used so far, the last at sizes[i-1]
    best = [0] + [waste(0, i) for i in range(1, m + 1)]
    choice = [[0] * (m + 1)]
    for _ in range(1, k):
        new = [0] + [inf] * m
        arg = [0] * (m + 1)
        for i in range(1, m + 1):
            for j in range(1, i):
                c = best[j] + waste(j, i)
                if c < new[i]:
                    new[i], arg[i] = c, j
            if best[i] <= new[i]:  # fewer buckets do as well
                new[i], arg[i] = best[i], -1
        best = new
        choice.append(arg)
    out = []
    i, level = m, k - 1
    while i > 0:
        j = choice[level][i] if level > 0 else 0
        if j == -1:
            level -= 1
            continue
        out.append(sizes[i - 1])
        i, level = j, level - 1
    return sorted(out)


def padded_rows(buckets: Sequence[int], histogram: Mapping[int, int]) -> int:
    """Rows of padding that ``buckets`` add over ``histogram`` (sizes above the largest are chunked)."""
    table = BucketTable(buckets)
    total = 0
    for n, calls in _check_histogram(histogram).items():
        total += calls * sum(size - rows for _, rows, size in table.chunks(n))
    return total


def _check_histogram(histogram) -> Dict[int, int]:
    if not isinstance(histogram, Mapping) or not histogram:
        raise GraphwrapError("histogram must be a non-empty mapping of batch size -> number of calls")
    out = {}
    for n, c in histogram.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise GraphwrapError(f"histogram batch sizes must be positive ints, got {n!r}")
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            raise GraphwrapError(f"histogram counts must be non-negative ints, got {c!r} for size {n}")
        if c:
            out[n] = c
    if not out:
        raise GraphwrapError("histogram has no calls")
    return out


class Adaptive:
    """Bucket policy: at most ``k`` buckets fitted to the batch sizes actually served.

    Given ``histogram`` (batch size -> calls), the buckets are fitted at once. Otherwise the
    first ``warmup_calls`` calls run eagerly while their batch sizes are counted; then the
    buckets are fitted and captured as calls need them. Batches larger than every size seen
    are split over the largest bucket. Use it when traffic has a stable size distribution
    and padded rows cost real compute.
    """

    def __init__(self, k: int = 8, *, warmup_calls: int = 256, histogram: Optional[Mapping[int, int]] = None):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise GraphwrapError(f"k must be a positive int, got {k!r}")
        if histogram is None and (not isinstance(warmup_calls, int) or warmup_calls < 1):
            raise GraphwrapError(f"warmup_calls must be a positive int, got {warmup_calls!r}")
        self.k = k
        self.warmup_calls = warmup_calls
        self.histogram: Dict[int, int] = {} if histogram is None else _check_histogram(histogram)
        self.buckets: Optional[List[int]] = fit_buckets(self.histogram, k) if histogram is not None else None
        self.seen = 0

    def observe(self, n: int) -> Optional[List[int]]:
        """Count one call of ``n`` rows; the fitted buckets once the warm-up is complete."""
        h = self.histogram
        h[n] = h.get(n, 0) + 1
        self.seen += 1
        if self.seen >= self.warmup_calls and self.buckets is None:
            self.buckets = fit_buckets(h, self.k)
            return self.buckets
        return None

    def __repr__(self):
        return f"Adaptive(k={self.k}, warmup_calls={self.warmup_calls}, buckets={self.buckets})"


BucketSpec = Union[None, str, Sequence[int], Adaptive]


class BucketTable:
    """Maps a batch size to its bucket in constant time (one list index)."""

    def __init__(self, buckets: Union[None, Literal["default", "exact"], Sequence[int]] = None,
                 max_batch_size: Optional[int] = None):
        top = DEFAULT_MAX_BATCH_SIZE if max_batch_size is None else max_batch_size
        if buckets is None or (isinstance(buckets, str) and buckets == "default"):
            buckets = default_buckets(top)
        elif isinstance(buckets, str) and buckets == "exact":
            buckets = exact_buckets(top)
        elif isinstance(buckets, (str, Adaptive)):
            raise GraphwrapError(
                f'buckets={buckets!r} is not a list of sizes or a policy: use "default", "exact", '
                "graphwrap.Adaptive(...) (GraphedModule only) or a list of batch sizes"
            )
        else:
            buckets = list(buckets)
            if not buckets:
                raise GraphwrapError("buckets is empty; pass at least one batch size, e.g. buckets=[1, 8, 32]")
            bad = [b for b in buckets if not isinstance(b, int) or isinstance(b, bool) or b < 1]
            if bad:
                raise GraphwrapError(f"buckets must be positive ints, got {bad!r} in {buckets!r}")
            if max_batch_size is not None and max_batch_size != max(buckets):
                raise GraphwrapError(
                    f"max_batch_size={max_batch_size} does not match the largest bucket {max(buckets)}; "
                    "pass one of buckets= or max_batch_size=, not both"
                )
            buckets = sorted(set(buckets))
        self.buckets: Tuple[int, ...] = tuple(buckets)
        self.max = self.buckets[-1]
        table = [0] * (self.max + 1)
        i = 0
        for n in range(1, self.max + 1):
            while self.buckets[i] < n:
                i += 1
            table[n] = self.buckets[i]
        self._table = table

    def __len__(self):
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)

    def __repr__(self):
        return f"BucketTable({list(self.buckets)})"

    def bucket_for(self, n: int) -> int:
        """The smallest bucket that holds ``n`` rows; ``1 <= n <= self.max``."""
        return self._table[n]

    def size_for(self, n: int) -> int:
        """The bucket of ``n`` rows; above the largest bucket, a size on the same kind of grid
        continued (steps of one eighth of the power of two below: 288, 320, ... after 256), so a
        large batch pads at most 12.5% if it gets a graph of its own."""
        if n <= self.max:
            return self._table[n]
        b = self.max
        while b < n:
            b += max(8, 1 << (b.bit_length() - 4))
        return b

    def chunks(self, n: int) -> List[Tuple[int, int, int]]:
        """Split ``n`` rows into ``(start, rows, bucket)`` pieces, largest bucket first."""
        out = []
        start = 0
        while n - start > self.max:
            out.append((start, self.max, self.max))
            start += self.max
        rest = n - start
        if rest:
            out.append((start, rest, self._table[rest]))
        return out
