"""Timing a kernel call: the mean wall time of `reps` calls after one warm-up call."""

from __future__ import annotations

import time
from collections.abc import Callable


def ms_per_call(call: Callable[[], object], reps: int) -> float:
    """Milliseconds per call of `call`, averaged over `reps` calls after one warm-up call."""
    call()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - start) / reps * 1e3
