"""Counter-based randomness for sampling: the uniform a request draws for one token is a hash
of (its sampling seed, the token's position), nothing else.

So a seeded request gives the same tokens alone or in any batch, on a prefill worker or a
decode worker, after a preemption or a failover that recomputes it, and on any device:
there is no generator state to carry, and no generator object that could live on the wrong
device. The hash is splitmix64 (Steele et al., "Fast splittable pseudorandom number
generators"), computed on the host in exact integer arithmetic.
"""

from __future__ import annotations

import random

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """A float in (0, 1) with 53 random bits, determined by (`seed`, `position`)."""
    z = _mix64((_mix64((seed + _GOLDEN) & _MASK64) + position * _GOLDEN) & _MASK64)
    return ((z >> 11) + 0.5) / (1 << 53)


class SeedSource:
    """Sampling seeds for requests that bring none: a stream seeded by the engine's seed, so
    an engine started with the same seed and the same arrivals draws the same text."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def next_seed(self) -> int:
        return self._rng.getrandbits(63)
