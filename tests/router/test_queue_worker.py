"""The queue consumer: runs tasks, waits out a passing outage on the same delivery (backing
off), retries a task that failed unexpectedly on its next delivery, dead-letters a task that
keeps failing with the reason, survives a failed claim, and leaves running tasks pending when
stopped."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest

from duet.router.queue_worker import QueueWorker, RetryBackoff, RetryTask
from duet.session_store import Delivery, SessionStoreUnavailable, SqliteWorkQueue, Task

FAST = RetryBackoff(initial_s=0.01, max_s=0.04)


async def wait_results(queue: SqliteWorkQueue, task_ids: list[str]) -> list[dict[str, Any]]:
    async with asyncio.timeout(10):
        while None in (results := await queue.results(task_ids)):
            await asyncio.sleep(0.02)
    return results  # type: ignore[return-value]


def test_tasks_run_retry_and_dead_letter(tmp_path: Path) -> None:
    attempts: dict[str, list[int]] = {}

    async def runner(d: Delivery) -> dict[str, Any]:
        attempts.setdefault(d.task_id, []).append(d.num_deliveries)
        if d.task_id == "flaky" and len(attempts["flaky"]) == 1:
            raise RetryTask("engine stopped")
        if d.task_id == "poison":
            raise ValueError("boom")
        return {"echo": d.payload["x"]}

    async def main() -> None:
        async with SqliteWorkQueue(tmp_path / "q.db", lease_s=5.0, max_deliveries=2) as queue:
            tasks = [Task(name, "echo", {"x": name}) for name in ("ok", "flaky", "poison")]
            await queue.enqueue(tasks)
            worker = QueueWorker(
                queue, {"echo": runner}, lambda n: 4 - n, poll_interval_s=0.02, backoff=FAST
            )
            await worker.start()
            try:
                results = await wait_results(queue, ["ok", "flaky", "poison"])
            finally:
                await worker.stop()
            assert results[:2] == [{"echo": "ok"}, {"echo": "flaky"}]
            assert results[2]["error"]["code"] == "dead_letter"
            # The passing failure ran again on the same delivery; the fault used both.
            assert attempts == {"ok": [1], "flaky": [1, 1], "poison": [1, 2]}
            [dead] = await queue.dead_letters()
            assert (dead.task_id, dead.reason) == ("poison", "ValueError: boom")
            assert worker.num_completed == 2

    asyncio.run(main())


def test_the_claim_loop_survives_a_failed_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        async with SqliteWorkQueue(tmp_path / "q.db") as queue:
            real_claim = queue.claim
            calls: list[int] = []

            async def flaky_claim(consumer: str, max_tasks: int = 1) -> list[Delivery]:
                calls.append(1)
                if len(calls) == 1:
                    raise RuntimeError("a bug in the backend")
                return await real_claim(consumer, max_tasks)

            monkeypatch.setattr(queue, "claim", flaky_claim)
            await queue.enqueue([Task("t", "echo", {})])

            async def runner(d: Delivery) -> dict[str, Any]:
                return {"ok": True}

            worker = QueueWorker(queue, {"echo": runner}, lambda n: 1, poll_interval_s=0.02)
            await worker.start()
            try:
                assert await wait_results(queue, ["t"]) == [{"ok": True}]
            finally:
                await worker.stop()
            assert len(calls) >= 2

    asyncio.run(main())


def test_stopping_leaves_running_tasks_pending(tmp_path: Path) -> None:
    started = asyncio.Event()

    async def forever(d: Delivery) -> dict[str, Any]:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def main() -> None:
        async with SqliteWorkQueue(tmp_path / "q.db", lease_s=0.2) as queue:
            await queue.enqueue([Task("t", "echo", {})])
            worker = QueueWorker(queue, {"echo": forever}, lambda n: 1 - n, poll_interval_s=0.02)
            await worker.start()
            await asyncio.wait_for(started.wait(), 10)
            await worker.stop()
            assert await queue.results(["t"]) == [None]
            assert await queue.num_pending() == 1
            await asyncio.sleep(0.3)  # the lease runs out: another router takes it over
            [d] = await queue.claim("next-router")
            assert (d.task_id, d.num_deliveries) == ("t", 2)

    asyncio.run(main())


def test_an_outage_spends_no_deliveries(tmp_path: Path) -> None:
    """Seven passing failures in a row (the cluster has no decode worker, then the queue's
    backend is down) on a queue that allows two deliveries: the task waits them out on its
    first delivery, backing off with a growing wait, and completes; nothing is dead-lettered."""
    runs: list[tuple[int, float]] = []

    async def runner(d: Delivery) -> dict[str, Any]:
        runs.append((d.num_deliveries, asyncio.get_running_loop().time()))
        if len(runs) <= 5:
            raise RetryTask("503 service_unavailable: no decode worker is available")
        if len(runs) <= 7:
            raise SessionStoreUnavailable("redis: connection refused")
        return {"ok": True}

    async def main() -> None:
        async with SqliteWorkQueue(tmp_path / "q.db", lease_s=5.0, max_deliveries=2) as queue:
            await queue.enqueue([Task("t", "echo", {})])
            backoff = RetryBackoff(initial_s=0.01, max_s=0.08)
            worker = QueueWorker(
                queue, {"echo": runner}, lambda n: 1 - n, poll_interval_s=0.02, backoff=backoff
            )
            await worker.start()
            try:
                assert await wait_results(queue, ["t"]) == [{"ok": True}]
            finally:
                await worker.stop()
            assert [n for n, _ in runs] == [1] * 8
            assert worker.num_retries == 7 and worker.num_completed == 1
            assert await queue.dead_letters() == []
            assert await queue.num_pending() == 0
            waits = [b - a for (_, a), (_, b) in itertools.pairwise(runs)]
            # Each wait is drawn from the upper half of its ceiling: 0.01, 0.02, 0.04, 0.08...
            assert all(w >= 0.005 for w in waits) and max(waits[3:]) >= 0.04

    asyncio.run(main())


def test_a_delivery_gives_up_after_the_backoff_window(tmp_path: Path) -> None:
    async def always_down(d: Delivery) -> dict[str, Any]:
        raise RetryTask("503 no decode worker is available")

    async def main() -> None:
        async with SqliteWorkQueue(tmp_path / "q.db", lease_s=5.0, max_deliveries=1) as queue:
            await queue.enqueue([Task("t", "echo", {})])
            backoff = RetryBackoff(initial_s=0.01, max_s=0.02, window_s=0.1)
            worker = QueueWorker(
                queue, {"echo": always_down}, lambda n: 1 - n, poll_interval_s=0.02,
                backoff=backoff,
            )  # fmt: skip
            await worker.start()
            try:
                [result] = await wait_results(queue, ["t"])
            finally:
                await worker.stop()
            assert result["error"] == {
                "code": "dead_letter", "message": "503 no decode worker is available"
            }  # fmt: skip
            assert worker.num_retries >= 3

    asyncio.run(main())


def test_backoff_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="initial_s, max_s"):
        RetryBackoff(initial_s=2.0, max_s=1.0)
    with pytest.raises(ValueError, match="window_s"):
        RetryBackoff(window_s=0)
    assert 4.0 <= RetryBackoff(initial_s=1.0, max_s=8.0).delay_s(3) <= 8.0
    assert 4.0 <= RetryBackoff(initial_s=1.0, max_s=8.0).delay_s(60) <= 8.0
