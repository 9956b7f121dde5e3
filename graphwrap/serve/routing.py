"""Which replica takes a generate call: the one that served a prompt starting alike, where its
prefix cache may still hold it, else the one with the fewest calls in flight (plain Python).

A prompt is known by chained hashes of its leading full blocks (16 tokens each, the paged
pool's block): block ``i``'s hash covers every token before it, so a match of ``k`` hashes is a
shared prefix of ``k`` blocks (a collision costs a routing choice, never an answer: each replica
checks its own blocks' tokens). Each replica remembers the hashes of the prompts it was given,
the most recently seen last, up to ``remembered``; a call goes to the replica that matches the
most of its blocks, unless that replica has more than ``slack`` calls in flight beyond the least
loaded one (then to the least loaded: affinity must not pile every call on one device).
"""

import collections
from typing import List, Sequence

from ..decoding.cache.pool import chain_hashes

BLOCK = 16  # tokens per block (the paged pool's: graphwrap.decoding.cache.pool.BLOCK)
REMEMBERED = 100_000  # block hashes each replica keeps
SLACK = 8  # calls in flight a replica may have beyond the least loaded one and still take a match


def block_hashes(tokens: Sequence[int], block: int = BLOCK) -> List[int]:
    """The chained hashes of ``tokens``' full blocks."""
    return chain_hashes(tokens, block, len(tokens) // block)


def matched(hashes: Sequence[int], seen: "collections.OrderedDict[int, None]") -> int:
    """How many of a prompt's leading blocks (``hashes``) a replica that was given ``seen`` holds."""
    k = 0
    while k < len(hashes) and hashes[k] in seen:
        k += 1
    return k


def remember(seen: "collections.OrderedDict[int, None]", hashes: Sequence[int], remembered: int = REMEMBERED):
    """A prompt's block hashes given to a replica: the most recently seen last, the oldest past
    ``remembered`` forgotten."""
    for h in hashes:
        seen[h] = None
        seen.move_to_end(h)
    while len(seen) > remembered:
        seen.popitem(last=False)


class PrefixRouter:
    """Picks a replica for a prompt; ``pick`` returns its index and remembers the prompt there."""

    def __init__(self, replicas: int, remembered: int = REMEMBERED, slack: int = SLACK, block: int = BLOCK):
        self.seen: List["collections.OrderedDict[int, None]"] = [collections.OrderedDict() for _ in range(replicas)]
        self.remembered, self.slack, self.block = remembered, slack, block
        self.routed: "collections.Counter[str]" = collections.Counter()  # "prefix" (a match chose it) or "load"

    def pick(self, tokens: Sequence[int], inflight: Sequence[float], start: int = 0) -> int:
        """The replica for ``tokens``, given each one's calls in flight (ties to the least loaded
        go round from ``start``)."""
        n = len(self.seen)
        least = min(range(n), key=lambda i: (inflight[i], (i - start) % n))
        hashes = block_hashes(tokens, self.block)
        best, most = least, 0
        for i, seen in enumerate(self.seen):
            k = matched(hashes, seen)
            if k > most and inflight[i] <= inflight[least] + self.slack:
                best, most = i, k
        self.routed["prefix" if most else "load"] += 1
        remember(self.seen[best], hashes, self.remembered)
        return best
