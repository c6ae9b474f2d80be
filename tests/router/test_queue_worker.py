"""The queue consumer: runs tasks, retries a failed one on its next delivery, dead-letters a
task that keeps failing with the reason, survives a failed claim, and leaves running tasks
pending when stopped."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from duet.router.queue_worker import QueueWorker, RetryTask
from duet.session_store import Delivery, SqliteWorkQueue, Task


async def wait_results(queue: SqliteWorkQueue, task_ids: list[str]) -> list[dict[str, Any]]:
    async with asyncio.timeout(10):
        while None in (results := await queue.results(task_ids)):
            await asyncio.sleep(0.02)
    return results  # type: ignore[return-value]


def test_tasks_run_retry_and_dead_letter(tmp_path: Path) -> None:
    attempts: dict[str, list[int]] = {}

    async def runner(d: Delivery) -> dict[str, Any]:
        attempts.setdefault(d.task_id, []).append(d.num_deliveries)
        if d.task_id == "flaky" and d.num_deliveries == 1:
            raise RetryTask("engine stopped")
        if d.task_id == "poison":
            raise ValueError("boom")
        return {"echo": d.payload["x"]}

    async def main() -> None:
        async with SqliteWorkQueue(tmp_path / "q.db", lease_s=5.0, max_deliveries=2) as queue:
            tasks = [Task(name, "echo", {"x": name}) for name in ("ok", "flaky", "poison")]
            await queue.enqueue(tasks)
            worker = QueueWorker(queue, {"echo": runner}, lambda n: 4 - n, poll_interval_s=0.02)
            await worker.start()
            try:
                results = await wait_results(queue, ["ok", "flaky", "poison"])
            finally:
                await worker.stop()
            assert results[:2] == [{"echo": "ok"}, {"echo": "flaky"}]
            assert results[2]["error"]["code"] == "dead_letter"
            assert attempts == {"ok": [1], "flaky": [1, 2], "poison": [1, 2]}
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
