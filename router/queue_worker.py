"""The consumer side of the work queue: every router replica runs one `QueueWorker`.

The worker claims tasks while `free_slots()` says there is room, runs each with the runner for
its kind, renews the lease while it runs, and completes it with the result (stored once, then
acknowledged). A runner that raises `RetryTask` (overload, no worker to run it, an engine that
stopped) or finds the queue's backend down has met a passing outage, not a fault of the task:
the worker keeps the delivery (and its lease) and runs it again after an exponential back-off
with jitter (`RetryBackoff`), so an outage spends no deliveries however long it lasts, up to the
back-off's window. Only a task that keeps failing unexpectedly is given back
(`WorkQueue.fail`) for another delivery, up to the queue's `max_deliveries`, after which it is
dead-lettered with the reason; a request's own error (a 4xx) is a result, not a failure. A
router that dies simply stops renewing: its tasks are taken over by the next claim after their
lease expires. Stopping the worker (router shutdown) cancels its running tasks without a
result; they are taken over the same way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from duet.session_store import Delivery, SessionStoreUnavailable, WorkQueue

logger = logging.getLogger(__name__)

TaskRunner = Callable[[Delivery], Awaitable[dict[str, Any]]]


class RetryTask(Exception):
    """The task could not run now (the server is overloaded, no worker can take it, its engine
    stopped): run it again after a back-off, on the same delivery."""


@dataclass(frozen=True)
class RetryBackoff:
    """How long a task that met a passing outage waits before its next run on the same
    delivery: `initial_s`, doubling up to `max_s`, each wait drawn in its upper half (jitter,
    so tasks that failed together do not come back together)."""

    initial_s: float = 0.5
    """The first wait."""
    max_s: float = 15.0
    """The longest wait: how late a task may notice that the cluster has room again."""
    window_s: float = 24 * 3600.0
    """How long one delivery keeps retrying before it is given back (a delivery counted): a
    batch's completion window; a batch line ends sooner, when its batch expires."""

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(
                f"initial_s, max_s: need 0 < initial_s <= max_s; got {self.initial_s}, {self.max_s}"
            )
        if not self.window_s > 0:
            raise ValueError(f"window_s: must be > 0; got {self.window_s}")

    def delay_s(self, num_retries: int) -> float:
        """The wait before retry number `num_retries` (0 for the first)."""
        ceiling = min(self.max_s, self.initial_s * 2.0 ** min(num_retries, 62))
        return ceiling * random.uniform(0.5, 1.0)


def consumer_name() -> str:
    """Unique per process and start: `host-pid-random`."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class QueueWorker:
    """Claims and runs tasks on the event loop it was started in."""

    def __init__(
        self,
        queue: WorkQueue,
        runners: Mapping[str, TaskRunner],
        free_slots: Callable[[int], int],
        *,
        consumer: str | None = None,
        poll_interval_s: float = 0.2,
        backoff: RetryBackoff | None = None,
    ) -> None:
        """`free_slots(num_running)`: how many more tasks may run now, given that this worker
        runs `num_running` (the priority policy lives there; a task waiting out an outage
        counts as running, so an outage claims nothing more)."""
        self.queue = queue
        self.backoff = backoff or RetryBackoff()
        self.runners = dict(runners)
        self.free_slots = free_slots
        self.consumer = consumer or consumer_name()
        self.poll_interval_s = poll_interval_s
        self._loop_task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._wake = asyncio.Event()
        """Set when a task ends, so the next claim comes at once rather than at the next poll."""
        self.num_completed = 0
        """Tasks this worker stored a result for (duplicates excluded)."""
        self.num_retries = 0
        """Runs repeated after a passing outage, on the same delivery."""

    @property
    def num_running(self) -> int:
        return len(self._running)

    async def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._claim_loop(), name="duet-queue-worker")
            logger.info("work queue consumer %s started", self.consumer)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop claiming and cancel running tasks (they stay pending for a takeover)."""
        self._stopping = True
        tasks = [t for t in (self._loop_task, *self._running) if t is not None]
        self._loop_task = None
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def _claim_loop(self) -> None:
        backoff_s = self.poll_interval_s
        while not self._stopping:
            wanted = self.free_slots(len(self._running))
            deliveries: list[Delivery] = []
            if wanted > 0:
                try:
                    deliveries = await self.queue.claim(self.consumer, wanted)
                    backoff_s = self.poll_interval_s
                except Exception as e:  # the loop must outlive any one failed claim
                    if isinstance(e, SessionStoreUnavailable):
                        logger.warning(
                            "work queue unavailable, retrying in %.1fs: %s", backoff_s, e
                        )
                    else:
                        logger.error("claiming from the work queue failed", exc_info=e)
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(5.0, backoff_s * 2)
                    continue
            for delivery in deliveries:
                task = asyncio.create_task(self._run(delivery), name=f"task {delivery.task_id}")
                self._running.add(task)
                task.add_done_callback(self._on_done)
            if not deliveries:
                self._wake.clear()
                # NOTE: asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a
                # cancellation that races with the event being set (a task ending as the worker
                # stops), and the loop would run on.
                try:
                    async with asyncio.timeout(self.poll_interval_s):
                        await self._wake.wait()
                except TimeoutError:
                    pass

    def _on_done(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._wake.set()

    async def _run_until_done(self, delivery: Delivery) -> dict[str, Any]:
        """The runner's result, running it again after each passing outage (`RetryTask`, the
        backend down) for up to the back-off's window; then that failure is raised."""
        runner = self.runners.get(delivery.kind)
        if runner is None:  # another router may know it: give it back at once
            raise RetryTask(f"no runner for task kind {delivery.kind!r} on this router")
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self.backoff.window_s
        num_retries = 0
        while True:
            try:
                return await runner(delivery)
            except (RetryTask, SessionStoreUnavailable) as e:
                delay_s = self.backoff.delay_s(num_retries)
                if loop.time() + delay_s >= give_up_at:
                    raise
                logger.warning(
                    "task %s: %s; running it again in %.1fs (delivery %d kept)",
                    delivery.task_id, e, delay_s, delivery.num_deliveries,
                )  # fmt: skip
            # NOTE: the lease is renewed meanwhile (`_keep_lease`): waiting here, rather than
            # giving the task back, is what keeps an outage from spending its deliveries.
            await asyncio.sleep(delay_s)
            num_retries += 1
            self.num_retries += 1

    async def _run(self, delivery: Delivery) -> None:
        work = asyncio.ensure_future(self._run_until_done(delivery))
        renewer = asyncio.create_task(self._keep_lease(delivery, work))
        try:
            result = await work
        except asyncio.CancelledError:
            if self._stopping:
                raise  # leave the task pending: another consumer takes it over
            logger.warning("task %s: taken over by another consumer", delivery.task_id)
            return
        except Exception as e:
            passing = isinstance(e, (RetryTask, SessionStoreUnavailable))
            reason = str(e) if isinstance(e, RetryTask) else f"{type(e).__name__}: {e}"
            if not passing:
                logger.error("task %s failed", delivery.task_id, exc_info=e)
            await self._settle("fail", delivery, lambda: self.queue.fail(delivery, reason))
            return
        finally:
            renewer.cancel()
        stored = await self._settle(
            "complete", delivery, lambda: self.queue.complete(delivery, result)
        )
        if stored:
            self.num_completed += 1

    async def _keep_lease(self, delivery: Delivery, work: asyncio.Future[Any]) -> None:
        interval_s = self.queue.lease_s / 3
        while not work.done():
            await asyncio.sleep(interval_s)
            try:
                if not await self.queue.renew(delivery):
                    work.cancel()
                    return
            except Exception as e:  # keep trying: the lease may still hold at the next one
                logger.warning("task %s: lease renewal failed: %s", delivery.task_id, e)

    async def _settle(
        self, op: str, delivery: Delivery, call: Callable[[], Awaitable[bool]]
    ) -> bool:
        """Retry storing the outcome while the lease would hold; after that the task is
        another consumer's to run again (its result is stored once either way)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.queue.lease_s
        while True:
            try:
                return await call()
            except SessionStoreUnavailable as e:
                if loop.time() >= deadline:
                    logger.error(
                        "task %s: %s failed, left for takeover: %s", delivery.task_id, op, e
                    )
                    return False
                await asyncio.sleep(min(1.0, self.queue.lease_s / 10))
