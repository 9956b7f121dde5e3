"""Which replica takes a generate call: the one that served a prompt starting alike, where its
prefix cache may still hold it, else the one with the fewest calls in flight (plain Python).

A prompt is known by chained hashes of its leading full blocks (16 tokens each, the paged
pool's block): block ``i``'s hash covers every token before it, so a match of ``k`` hashes is a
shared prefix of ``k`` blocks (a collision costs a routing choice, never an answer: each replica
checks its own blocks' tokens). Each replica remembers the hashes of the prompts it was given,
the most recently seen last, up to ``remembered``.

A call goes to the replica that matches the most of its blocks (ties: the less loaded) when:

- the match covers at least ``share`` of the prompt's full blocks (a chat template's first
  block, alike in every chat, is no reason to pile every call on one replica), and
- that replica has no more calls in flight than the least loaded one plus the larger of
  ``slack`` and ``balance`` times the least loaded one's (a burst of a group's calls stays on
  the replica that holds its prefix; affinity never starves the others).

Else it goes to the least loaded.
"""

import collections
import math
from typing import List, Optional, Sequence

from ..decoding.cache.pool import chain_hashes

BLOCK = 16  # tokens per block (the paged pool's: graphwrap.decoding.cache.pool.BLOCK)
REMEMBERED = 100_000  # block hashes each replica keeps
SLACK = 8  # calls in flight a replica may have beyond the least loaded one and still take a match, however few
BALANCE = 0.5  # ... or this share of the least loaded one's calls, where that is more
SHARE = 0.3  # the share of a prompt's full blocks a match must cover


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


def choose(hashes: Sequence[int], seen: Sequence[Optional["collections.OrderedDict[int, None]"]],
           load: Sequence[float], slack: float = SLACK, balance: float = BALANCE, share: float = SHARE) -> Optional[int]:
    """The replica (an index into ``seen`` and ``load``) whose match the rules in this module's
    docstring let take a prompt of block hashes ``hashes``, or None (the least loaded takes it)."""
    if not hashes:
        return None
    least = min(load)
    most = max(slack, balance * least) + least
    need = max(1, math.ceil(share * len(hashes)))
    best, key = None, None
    for i, s in enumerate(seen):
        if s is None or load[i] > most:
            continue
        k = matched(hashes, s)
        if k >= need and (key is None or (-k, load[i]) < key):
            best, key = i, (-k, load[i])
    return best


class PrefixRouter:
    """Picks a replica for a prompt; ``pick`` returns its index and remembers the prompt there."""

    def __init__(self, replicas: int, remembered: int = REMEMBERED, slack: float = SLACK, balance: float = BALANCE,
                 share: float = SHARE, block: int = BLOCK):
        self.seen: List["collections.OrderedDict[int, None]"] = [collections.OrderedDict() for _ in range(replicas)]
        self.remembered, self.slack, self.balance, self.share, self.block = remembered, slack, balance, share, block
        self.routed: "collections.Counter[str]" = collections.Counter()  # "prefix" (a match chose it) or "load"

    def pick(self, tokens: Sequence[int], inflight: Sequence[float], start: int = 0) -> int:
        """The replica for ``tokens``, given each one's calls in flight (ties to the least loaded
        go round from ``start``)."""
        n = len(self.seen)
        hashes = block_hashes(tokens, self.block)
        best = choose(hashes, self.seen, inflight, self.slack, self.balance, self.share)
        self.routed["load" if best is None else "prefix"] += 1
        if best is None:
            best = min(range(n), key=lambda i: (inflight[i], (i - start) % n))
        remember(self.seen[best], hashes, self.remembered)
        return best
