"""A token's log-probabilities as the decode thread hands them over, packed: plain Python, so the
server's HTTP side unpacks them without torch."""

import struct
from typing import List, NamedTuple, Tuple


class Logprobs(NamedTuple):
    """A token's log-probabilities, still packed: its step's rows as float32 bytes
    (:func:`~.sampling.logprobs`: each row the chosen token's log-probability, then the ``most``
    highest and their ids), its row, and how many of the highest its sequence asked for (``k``).
    Made on the decode thread without a Python number per value, pickled with its step's bytes
    once per message, unpacked where the numbers are wanted (:meth:`unpack`)."""

    step: bytes
    row: int
    most: int
    k: int

    def unpack(self) -> Tuple[float, List[Tuple[int, float]]]:
        """``(log-probability, [(id, log-probability), ...])``, the ``k`` most likely first."""
        width = 1 + 2 * self.most
        v = struct.unpack_from(f"{width}f", self.step, 4 * width * self.row)
        return v[0], [(int(v[1 + self.most + j]), v[1 + j]) for j in range(min(self.k, self.most))]
