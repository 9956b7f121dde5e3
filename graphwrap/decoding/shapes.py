"""Which graph shape serves a forward of the shared batch (plain Python)."""

import collections
from typing import Counter, Set

CAPTURE_AFTER = 16  # steps a shape is wanted, served by a larger captured one, before it is captured


class Shapes:
    """Which graph shape serves a forward: its own buckets once they have a graph, or once they
    have been wanted ``CAPTURE_AFTER`` times (the capture then runs in the decode thread); until
    then the smallest shape of its kind already captured that holds it (more padding rows and
    masked positions, the same tokens), so that a passing shape does not stall every row for a
    capture. Shapes are ``(kind, rows, positions)``."""

    def __init__(self):
        self.ready: Set[tuple] = set()
        self.wanted: Counter[tuple] = collections.Counter()
        self.covered: Counter[tuple] = collections.Counter()

    def pick(self, shape: tuple, graphs: bool) -> tuple:
        if not graphs or shape in self.ready:
            return shape
        self.wanted[shape] += 1
        cover = [s for s in self.ready if s[0] == shape[0] and s[1] >= shape[1] and s[2] >= shape[2]]
        if cover and self.wanted[shape] < CAPTURE_AFTER:
            self.covered[shape[0]] += 1
            return min(cover, key=lambda s: s[1] * s[2])
        self.ready.add(shape)
        del self.wanted[shape]
        return shape
