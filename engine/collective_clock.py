"""How long this process spent in the engine's collectives: the tensor-parallel all-reduces,
gathers and broadcasts, the pipeline's stage sends and receives, and the broadcast of each
iteration's commands. A step's time is this (communication, and waiting for a slower rank)
plus compute; `benchmarks.offline.throughput --tensor-parallel-size N` reports the split."""

from __future__ import annotations

import time
from types import TracebackType


class CollectiveClock:
    """Seconds and calls, summed over the process's life; read the difference over a window.
    `with COLLECTIVES:` around a collective adds its time (two clock reads, well under a
    microsecond, so it stays on)."""

    __slots__ = ("_start", "calls", "seconds")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.seconds += time.perf_counter() - self._start
        self.calls += 1


COLLECTIVES = CollectiveClock()
"""The process's one clock. Collectives run on the engine thread only, one at a time, so one
start time serves (a nested `with` would be a bug: none nests)."""
