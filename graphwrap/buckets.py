"""Batch-size buckets: which captured size serves a batch, and how an oversized batch is split."""

from typing import List, Optional, Sequence, Tuple

from .errors import GraphwrapError

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


class BucketTable:
    """Maps a batch size to its bucket in constant time (one list index)."""

    def __init__(self, buckets: Optional[Sequence[int]] = None, max_batch_size: Optional[int] = None):
        if buckets is None:
            buckets = default_buckets(DEFAULT_MAX_BATCH_SIZE if max_batch_size is None else max_batch_size)
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
