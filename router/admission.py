"""Admission control: a bounded queue in front of the engine.

The engine runs up to `max_running` sequences at once; more may wait behind them. A request
weighs as many sequences as it asks the engine for (`n` per prompt). Two ways to bound the wait:

- a fixed `max_queued` (`--max-queued-requests N`): a request that would make more than N
  sequences wait is refused at once with 503 and Retry-After;
- the default (`max_queued=None`): a request is refused only when the queue ahead of it could
  not drain within `max_queue_wait_s`. The drain rate is measured: sequences leaving the router
  per second while it was saturated (every running slot taken), over the last `RATE_WINDOW_S`.
  Below saturation departures only echo arrivals, so those are not counted. That rate already reflects the KV
  capacity (how many sequences fit in the pool at once) and the model's speed, so the bound
  follows the deployment without a number to tune. Until enough sequences have finished to
  measure a rate, requests are admitted up to `AUTO_MAX_QUEUED`, a bound on the router's memory
  only. So a load tool's burst (guidellm's 512 concurrent requests) queues as it would on vLLM,
  and a server that truly cannot keep up sheds load before its clients time out.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from duet.router.errors import OpenAIError, OverloadedError
from duet.router.queue_worker import RetryTask

T = TypeVar("T")
OVERLOAD_WAIT_S = 60.0
"""How long a queued task waits for admission before it is given back for a retry."""

DEFAULT_MAX_QUEUE_WAIT_S = 300.0
"""Default longest estimated wait in the queue: half of the OpenAI SDKs' 600 s request timeout,
leaving the other half for the request to run."""

AUTO_MAX_QUEUED = 8192
"""With the default (time-bounded) queue: the most sequences that may wait, whatever the rate."""

RATE_WINDOW_S = 60.0
"""The drain rate is measured over saturated time within this many recent seconds."""

MIN_RATE_SAMPLES = 4
"""Sequences that must have finished in the window before the measured rate is trusted."""


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
        self,
        max_running: int | Callable[[], int],
        max_queued: int | None = None,
        retry_after_s: int = 1,
        max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`max_running`: a number, or a function read at each admission (a cluster's capacity
        follows its decode pool). `max_queued`: a fixed bound on waiting sequences, or None to
        bound the estimated wait by `max_queue_wait_s` instead (see the module docstring)."""
        if isinstance(max_running, int):
            if max_running < 1:
                raise ValueError(f"max_running: must be >= 1; got {max_running}")
            fixed = max_running
            max_running = lambda: fixed  # noqa: E731
        if max_queued is not None and max_queued < 0:
            raise ValueError(f"max_queued_requests: must be >= 0; got {max_queued}")
        if not max_queue_wait_s > 0:
            raise ValueError(f"max_queue_wait_s: must be > 0; got {max_queue_wait_s}")
        self._max_running = max_running
        self.max_queued = max_queued
        self.max_queue_wait_s = max_queue_wait_s
        self.retry_after_s = retry_after_s
        self.num_in_flight = 0
        self._clock = clock
        self._saturated_since: float | None = None
        self._saturated: deque[tuple[float, float]] = deque()  # closed (start, end) intervals
        self._finished: deque[tuple[float, int]] = deque()  # (time, weight) while saturated

    @property
    def max_running(self) -> int:
        return max(1, self._max_running())

    @property
    def capacity(self) -> int:
        """The most sequences in flight at once (running + the queue's hard bound)."""
        limit = AUTO_MAX_QUEUED if self.max_queued is None else self.max_queued
        return self.max_running + limit

    @property
    def num_queued(self) -> int:
        return max(0, self.num_in_flight - self.max_running)

    def drain_rate(self) -> float | None:
        """Sequences leaving per second while saturated, over the last `RATE_WINDOW_S`; None
        until `MIN_RATE_SAMPLES` have left in that time."""
        now = self._clock()
        start = now - RATE_WINDOW_S
        self._forget_before(start)
        weight = sum(w for _, w in self._finished)
        if weight < MIN_RATE_SAMPLES:
            return None
        busy = sum(end - max(begin, start) for begin, end in self._saturated)
        if self._saturated_since is not None:
            busy += now - max(self._saturated_since, start)
        return weight / max(busy, 1e-3)

    def estimated_wait_s(self, weight: int) -> float | None:
        """How long `weight` more sequences would wait at the back of the queue; None until
        the drain rate is measured."""
        rate = self.drain_rate()
        if rate is None:
            return None
        return max(0, self.num_in_flight + weight - self.max_running) / rate

    def can_admit(self, weight: int) -> bool:
        # An idle server takes any one request, however heavy, so none is refused forever.
        if self.num_in_flight == 0:
            return True
        if self.num_in_flight + weight > self.capacity:
            return False
        if self.max_queued is not None or self.num_in_flight + weight <= self.max_running:
            return True
        wait = self.estimated_wait_s(weight)
        return wait is None or wait <= self.max_queue_wait_s

    def admit(self, weights: Sequence[int]) -> list[AdmissionTicket]:
        """Take capacity for a request's engine requests (one weight each), all or none.
        Raises `OverloadedError` (503) when they do not fit."""
        total = sum(weights)
        if not self.can_admit(total):
            wait = self.estimated_wait_s(total) if self.max_queued is None else None
            why = (
                f"room for {self.capacity}"
                if wait is None or self.num_in_flight + total > self.capacity
                else f"estimated queue wait {wait:.0f}s exceeds {self.max_queue_wait_s:g}s"
            )
            raise OverloadedError(
                f"server overloaded: {self.num_in_flight} sequences in flight, {why}; "
                f"retry after {self.retry_after_s}s",
                retry_after_s=self.retry_after_s,
            )
        self.num_in_flight += total
        if self._saturated_since is None and self.num_in_flight >= self.max_running:
            self._saturated_since = self._clock()
        return [AdmissionTicket(self, w) for w in weights]

    def _release(self, weight: int) -> None:
        now = self._clock()
        if self._saturated_since is not None:
            self._finished.append((now, weight))
            if self.num_in_flight - weight < self.max_running:
                self._saturated.append((self._saturated_since, now))
                self._saturated_since = None
        self.num_in_flight -= weight
        self._forget_before(now - RATE_WINDOW_S)

    def _forget_before(self, t: float) -> None:
        while self._finished and self._finished[0][0] < t:
            self._finished.popleft()
        while self._saturated and self._saturated[0][1] < t:
            self._saturated.popleft()


async def wait_out_overload(
    attempt: Callable[[], Awaitable[T]], max_wait_s: float = OVERLOAD_WAIT_S
) -> T:
    """`attempt()`, retried while admission refuses it (503 overloaded) for up to `max_wait_s`.

    NOTE: a queued task waits here, holding its lease (the worker renews it), rather than
    being given back: each give-back counts as a delivery, so a burst of interactive traffic
    would otherwise dead-letter batch lines."""
    deadline = asyncio.get_running_loop().time() + max_wait_s
    while True:
        try:
            return await attempt()
        except OverloadedError:
            if asyncio.get_running_loop().time() >= deadline:
                raise
            await asyncio.sleep(0.5)


async def admit_queued(admission: AdmissionController) -> AdmissionTicket:
    """One slot for a queued task (a batch line, a background request), waiting out overload
    (`wait_out_overload`); still refused after that, the task runs again after a back-off on
    the same delivery (`RetryTask`)."""

    async def admit() -> AdmissionTicket:
        [ticket] = admission.admit([1])
        return ticket

    try:
        return await wait_out_overload(admit)
    except OpenAIError as e:
        raise RetryTask(f"{e.status_code} {e.message}") from e
