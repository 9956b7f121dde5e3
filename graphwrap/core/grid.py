"""The bucket grid: batch sizes, sequence lengths, and the token budget that bounds their product.

A call of ``n`` rows and length ``L`` runs in the graph of bucket ``(B, S)``: ``S`` the smallest
sequence bucket that holds ``L`` (or ``L`` itself, where lengths are not padded), ``B`` the
smallest batch bucket that holds ``n`` among those with ``B * S <= max_tokens``. Batches above
that are served in chunks. Inputs without a sequence dimension have ``S = None`` and the batch
buckets alone. Pure Python: runs and is tested on a CPU.
"""

from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..errors import GraphwrapError
from .buckets import BucketTable

DEFAULT_MAX_SEQ_LEN = 512
DEFAULT_MAX_TOKENS = 16384


def default_seq_buckets(max_len: int = DEFAULT_MAX_SEQ_LEN) -> List[int]:
    """16, 32, 48, 64, 96, 128, 192, 256, ...: powers of two and one and a half times them, so a
    length above 32 is padded by at most a third, and ``max_len`` itself is always a bucket."""
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise GraphwrapError(f"the longest sequence bucket must be a positive int, got {max_len!r}")
    out, p = [], 16
    while p < max_len:
        out += [b for b in (p, p * 3 // 2) if b < max_len and (b == p or p >= 32)]
        p *= 2
    return sorted(set(out) | {max_len})


SeqSpec = Union[None, str, Sequence[int]]


class Grid:
    """Batch buckets, sequence buckets and the token budget; which bucket serves a call."""

    def __init__(self, batch: BucketTable, seq: SeqSpec = None, has_seq: bool = False,
                 max_tokens: Optional[int] = None):
        self.batch = batch
        self.exact = seq == "exact"
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise GraphwrapError(f"max_tokens must be a positive int, got {max_tokens!r}")
        self.max_tokens = max_tokens if max_tokens is not None else (DEFAULT_MAX_TOKENS if has_seq else None)
        if seq is None or seq == "default":
            self.seq = BucketTable(default_seq_buckets())
        elif self.exact:
            self.seq = BucketTable(default_seq_buckets())  # its top is the longest length served
        elif isinstance(seq, str):
            raise GraphwrapError(f'seq_buckets={seq!r} is not a list of lengths or a policy: use "default", '
                                 '"exact" or a list of lengths')
        else:
            lengths = list(seq) if hasattr(seq, "__iter__") and not isinstance(seq, (bytes, dict)) else None
            if not lengths or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in lengths):
                raise GraphwrapError(f'seq_buckets must be "default", "exact" or a non-empty list of lengths >= 1, '
                                     f"such as [32, 64, 128], got {seq!r}")
            self.seq = BucketTable(lengths)
        self.max_len = self.seq.max
        self._tables: Dict[Optional[int], BucketTable] = {None: batch}

    def seq_for(self, L: int, exact: bool = False) -> Optional[int]:
        """The sequence bucket of length ``L``; None when it is longer than the longest."""
        if L > self.max_len:
            return None
        return L if exact or self.exact else self.seq.bucket_for(max(L, 1))

    def table(self, S: Optional[int]) -> BucketTable:
        """The batch buckets at sequence bucket ``S``: those within the token budget."""
        t = self._tables.get(S)
        if t is None:
            top = max(1, self.max_tokens // S) if self.max_tokens and S else self.batch.max
            kept = [b for b in self.batch.buckets if b <= top] or [self.batch.buckets[0]]
            t = self._tables[S] = BucketTable(kept)
        return t

    def size(self, n: int, S: Optional[int]) -> int:
        """The batch bucket of ``n`` rows at ``S``; above the largest, the grid continued (a
        size for a graph of its own, see :meth:`BucketTable.size_for`)."""
        return self.table(S).size_for(n)

    def top(self, S: Optional[int]) -> int:
        return self.table(S).max

    def chunks(self, n: int, S: Optional[int]) -> List[Tuple[int, int, int]]:
        return self.table(S).chunks(n)

    def points(self, S_list: Optional[Sequence[int]] = None) -> List[Tuple[int, Optional[int]]]:
        """Every (batch, sequence) bucket, largest first (what ``capture()`` takes)."""
        if S_list is None:
            return [(b, None) for b in sorted(self.batch.buckets, reverse=True)]
        out = [(b, S) for S in S_list for b in self.table(S).buckets]
        return sorted(out, key=lambda p: (p[0] * (p[1] or 1), p[1] or 0), reverse=True)

    def seq_buckets(self) -> Tuple[int, ...]:
        return self.seq.buckets
