"""Admission control: a bounded queue in front of the engine.

The engine runs up to `max_running` sequences at once; up to `max_queued` more may wait
behind them. A request beyond that is refused at once with 503 and Retry-After instead of
queueing without bound (which only turns overload into timeouts). A request weighs as many
sequences as it asks the engine for (`n` per prompt).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from router.errors import OverloadedError


class AdmissionTicket:
    """One admitted request's share of the capacity. `release()` is idempotent."""

    def __init__(self, controller: AdmissionController, weight: int) -> None:
        self._controller = controller
        self.weight = weight
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._controller._release(self.weight)


class AdmissionController:
    """Counts sequences inside the router. Only the event loop's thread may call it."""

    def __init__(
        self, max_running: int | Callable[[], int], max_queued: int, retry_after_s: int = 1
    ) -> None:
        """`max_running`: a number, or a function read at each admission (a cluster's capacity
        follows its decode pool)."""
        if isinstance(max_running, int):
            if max_running < 1:
                raise ValueError(f"max_running: must be >= 1; got {max_running}")
            fixed = max_running
            max_running = lambda: fixed  # noqa: E731
        if max_queued < 0:
            raise ValueError(f"max_queued_requests: must be >= 0; got {max_queued}")
        self._max_running = max_running
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.num_in_flight = 0

    @property
    def max_running(self) -> int:
        return max(1, self._max_running())

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_queued

    @property
    def num_queued(self) -> int:
        return max(0, self.num_in_flight - self.max_running)

    def can_admit(self, weight: int) -> bool:
        # An idle server takes any one request, however heavy, so none is refused forever.
        return self.num_in_flight == 0 or self.num_in_flight + weight <= self.capacity

    def admit(self, weights: Sequence[int]) -> list[AdmissionTicket]:
        """Take capacity for a request's engine requests (one weight each), all or none.
        Raises `OverloadedError` (503) when they do not fit."""
        total = sum(weights)
        if not self.can_admit(total):
            raise OverloadedError(
                f"server overloaded: {self.num_in_flight} sequences in flight, room for "
                f"{self.capacity}; retry after {self.retry_after_s}s",
                retry_after_s=self.retry_after_s,
            )
        self.num_in_flight += total
        return [AdmissionTicket(self, w) for w in weights]

    def _release(self, weight: int) -> None:
        self.num_in_flight -= weight
