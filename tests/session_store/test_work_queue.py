"""The work queue's contract, run against both backends (SQLite and a real redis-server):
claim and complete, lease takeover, one result per task, retries and dead letters."""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from duet.session_store import (
    Delivery,
    RedisWorkQueue,
    SqliteWorkQueue,
    Task,
    WorkQueue,
    open_work_queue,
)
from tests.session_store.conftest import RedisServer

LEASE_S = 1.0


@pytest.fixture(params=["sqlite", "redis"])
def queue_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., WorkQueue]:
    """A factory for queues on one fresh, shared backend (each call: a new client on it)."""
    if request.param == "sqlite":
        path = tmp_path / "queue.db"
        return lambda **kw: SqliteWorkQueue(path, **{"lease_s": LEASE_S, **kw})
    server: RedisServer = request.getfixturevalue("redis_server")
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    return lambda **kw: RedisWorkQueue.from_url(
        server.url, key_prefix=prefix, **{"lease_s": LEASE_S, **kw}
    )


def tasks(n: int, kind: str = "echo") -> list[Task]:
    return [Task(f"t{i}", kind, {"i": i}) for i in range(n)]


def test_claim_complete_result(queue_factory: Callable[..., WorkQueue]) -> None:
    async def main() -> None:
        async with queue_factory(lease_s=30.0) as q:  # no lease runs out here, however slow
            await q.enqueue(tasks(3), record=("batch", "b1", {"id": "b1"}))
            assert await q.num_pending() == 3
            got = await q.claim("c1", max_tasks=2)
            assert [(d.task_id, d.payload, d.num_deliveries) for d in got] == [
                ("t0", {"i": 0}, 1),
                ("t1", {"i": 1}, 1),
            ]
            [third] = await q.claim("c2", max_tasks=5)
            assert third.task_id == "t2"
            assert await q.claim("c3") == []  # all leased
            assert await q.complete(got[0], {"out": 0}) is True
            assert await q.results(["t0", "t1", "nope"]) == [{"out": 0}, None, None]
            assert await q.num_pending() == 2
            assert await q.get_record("batch", "b1") == {"id": "b1"}
            assert await q.get_record("batch", "b2") is None

    asyncio.run(main())


def test_enqueue_with_results_and_records(queue_factory: Callable[..., WorkQueue]) -> None:
    async def main() -> None:
        async with queue_factory() as q:
            await q.enqueue(tasks(1), results={"bad": {"error": "x"}})
            assert await q.results(["bad", "t0"]) == [{"error": "x"}, None]
            await q.put_record("file", "f1", {"bytes": 3})
            await q.put_record("file", "f1", {"bytes": 4})
            assert await q.list_records("file") == [{"bytes": 4}]
            data = bytes(range(256))
            await q.put_blob("f1", data)
            assert await q.get_blob("f1") == data
            assert await q.get_blob("f2") is None
            assert await q.delete_record("file", "f1") is True
            assert await q.delete_record("file", "f1") is False
            assert await q.list_records("file") == []
            await q.delete_blob("f1")
            await q.delete_blob("f1")  # already gone: nothing to do
            assert await q.get_blob("f1") is None

    asyncio.run(main())


def test_expired_lease_is_taken_over_by_another_consumer(
    queue_factory: Callable[..., WorkQueue],
) -> None:
    async def main() -> None:
        async with queue_factory() as q:
            await q.enqueue(tasks(1))
            [first] = await q.claim("dead-router")
            assert await q.claim("live-router") == []  # the lease still holds
            [second] = await wait_for_async_claim(q, "live-router")
            assert (second.task_id, second.consumer, second.num_deliveries) == (
                "t0",
                "live-router",
                2,
            )
            assert await q.renew(first) is False  # no longer the dead router's
            assert await q.renew(second) is True
            assert await q.complete(second, {"by": "live"}) is True
            assert await q.num_pending() == 0

    asyncio.run(main())


async def wait_for_async_claim(q: WorkQueue, consumer: str) -> list[Delivery]:
    """Claim until something comes (a lease expires), at most 5 s."""
    deadline = asyncio.get_running_loop().time() + 5.0
    while not (claimed := await q.claim(consumer)):
        assert asyncio.get_running_loop().time() < deadline, "no takeover within 5 s"
        await asyncio.sleep(0.05)
    return claimed


def test_renew_keeps_the_task(queue_factory: Callable[..., WorkQueue]) -> None:
    async def main() -> None:
        async with queue_factory() as q:
            await q.enqueue(tasks(1))
            [d] = await q.claim("c1")
            for _ in range(4):  # 4 x 0.5 s > the 1 s lease
                await asyncio.sleep(LEASE_S / 2)
                assert await q.renew(d) is True
                assert await q.claim("c2") == []

    asyncio.run(main())


def test_a_task_delivered_twice_stores_one_result(
    queue_factory: Callable[..., WorkQueue],
) -> None:
    async def main() -> None:
        async with queue_factory() as q:
            await q.enqueue(tasks(1))
            [slow] = await q.claim("slow")
            [fast] = await wait_for_async_claim(q, "fast")
            assert await q.complete(fast, {"by": "fast"}) is True
            assert await q.complete(slow, {"by": "slow"}) is False
            assert await q.results(["t0"]) == [{"by": "fast"}]
            assert await q.num_pending() == 0
            # The same task id enqueued again after it has a result is never run again.
            await q.enqueue(tasks(1))
            assert await q.claim("c") == []
            assert await q.num_pending() == 0

    asyncio.run(main())


def test_fail_retries_then_dead_letters_with_the_reason(
    queue_factory: Callable[..., WorkQueue],
) -> None:
    async def main() -> None:
        async with queue_factory(max_deliveries=2) as q:
            await q.enqueue(tasks(1))
            [d1] = await q.claim("c1")
            assert await q.fail(d1, "engine said no") is False
            [d2] = await q.claim("c2")  # claimable at once, no lease wait
            assert d2.num_deliveries == 2
            assert await q.fail(d2, "engine said no again") is True
            assert await q.claim("c3") == []
            [dead] = await q.dead_letters()
            assert (dead.task_id, dead.reason, dead.num_deliveries, dead.payload) == (
                "t0",
                "engine said no again",
                2,
                {"i": 0},
            )
            assert await q.results(["t0"]) == [
                {"error": {"code": "dead_letter", "message": "engine said no again"}}
            ]

    asyncio.run(main())


def test_a_task_whose_consumers_keep_dying_is_dead_lettered(
    queue_factory: Callable[..., WorkQueue],
) -> None:
    async def main() -> None:
        async with queue_factory(max_deliveries=2) as q:
            await q.enqueue(tasks(1))
            assert len(await q.claim("c1")) == 1
            assert len(await wait_for_async_claim(q, "c2")) == 1

            async def buried() -> bool:
                assert await q.claim("c3") == []
                return bool(await q.dead_letters())

            deadline = asyncio.get_running_loop().time() + 5.0
            while not await buried():
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.05)
            [dead] = await q.dead_letters()
            assert dead.num_deliveries == 2
            assert dead.reason.startswith("delivered 2 times without a result")
            [result] = await q.results(["t0"])
            assert result is not None and result["error"]["code"] == "dead_letter"

    asyncio.run(main())


def test_concurrent_consumers_split_the_work(queue_factory: Callable[..., WorkQueue]) -> None:
    """Four consumers on separate clients drain 40 tasks: each task is delivered once."""

    async def main() -> None:
        queues = [queue_factory(lease_s=30.0) for _ in range(4)]
        try:
            await queues[0].enqueue(tasks(40))
            seen: list[str] = []

            async def consume(q: WorkQueue, name: str) -> None:
                while got := await q.claim(name, max_tasks=3):
                    for d in got:
                        seen.append(d.task_id)
                        assert await q.complete(d, {"by": name})

            await asyncio.wait_for(
                asyncio.gather(*(consume(q, f"c{i}") for i, q in enumerate(queues))), 30
            )
            assert sorted(seen) == sorted(f"t{i}" for i in range(40))
            assert await queues[0].num_pending() == 0
            assert None not in await queues[1].results([f"t{i}" for i in range(40)])
        finally:
            for q in queues:
                await q.close()

    asyncio.run(main())


def test_event_logs_append_once_per_offset(queue_factory: Callable[..., WorkQueue]) -> None:
    async def main() -> None:
        async with queue_factory() as q:
            assert await q.append_events("r1", 0, ["a", "b"]) == 2
            # A re-delivered task appends from where its first delivery began: no repeats.
            assert await q.append_events("r1", 0, ["a", "b", "c"]) == 3
            assert await q.append_events("r1", 3, ["d"]) == 4
            assert await q.read_events("r1", 0, 100) == ["a", "b", "c", "d"]
            assert await q.read_events("r1", 1, 2) == ["b", "c"]
            assert await q.read_events("r1", 4, 10) == []
            assert await q.read_events("other", 0, 10) == []
            with pytest.raises(ValueError, match="offset: 9 is past the end"):
                await q.append_events("r1", 9, ["z"])

    asyncio.run(main())


def test_an_event_log_expires_its_ttl_after_its_last_append(
    queue_factory: Callable[..., WorkQueue],
) -> None:
    """Each append restarts the log's lifetime; once it passes without one, the log is gone
    (reads as empty, and a new log of that id starts at offset 0), on every queue view."""

    async def main() -> None:
        async with queue_factory(event_ttl_s=1.0) as q:
            view = q.queue_named("background")
            assert view.event_ttl_s == 1.0
            await view.append_events("kept", 0, ["a"])
            await q.append_events("lapses", 0, ["x", "y"])
            for n in range(1, 4):  # 3 x 0.4 s > the 1 s lifetime, each append renewing it
                await asyncio.sleep(0.4)
                await view.append_events("kept", n, [f"a{n}"])
            assert await q.read_events("kept", 0, 10) == ["a", "a1", "a2", "a3"]
            assert await q.read_events("lapses", 0, 10) == []
            with pytest.raises(ValueError, match="offset: 2 is past the end"):
                await q.append_events("lapses", 2, ["z"])
            assert await q.append_events("lapses", 0, ["new"]) == 1
            assert await q.read_events("lapses", 0, 10) == ["new"]

    asyncio.run(main())


def test_an_event_log_ttl_and_the_retention_must_be_positive(tmp_path: Path) -> None:
    for ttl in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="event_ttl_s: must be > 0 seconds"):
            SqliteWorkQueue(tmp_path / "q.db", event_ttl_s=ttl)
        with pytest.raises(ValueError, match="retention_s: must be > 0 seconds"):
            SqliteWorkQueue(tmp_path / "q.db", retention_s=ttl)


def stored_counts(q: WorkQueue, request: pytest.FixtureRequest) -> dict[str, int]:
    """What the backend holds, expired or not: results, records of kind "batch", dead letters
    and blobs, counted in its own storage."""
    if isinstance(q, SqliteWorkQueue):
        with sqlite3.connect(q.path) as conn:
            count = lambda sql: int(conn.execute(sql).fetchone()[0])  # noqa: E731
            return {
                "results": count("SELECT COUNT(*) FROM queue_results"),
                "records": count("SELECT COUNT(*) FROM queue_records WHERE kind = 'batch'"),
                "dead": count("SELECT COUNT(*) FROM queue_dead"),
                "blobs": count("SELECT COUNT(*) FROM queue_blobs"),
                "expiries": count("SELECT COUNT(*) FROM queue_expiry"),
            }
    assert isinstance(q, RedisWorkQueue)
    server: RedisServer = request.getfixturevalue("redis_server")
    client = redis.Redis.from_url(server.url)
    p = q.key_prefix
    try:
        return {
            "results": int(client.hlen(f"{p}:queue:results")),
            "records": int(client.hlen(f"{p}:records:batch")),
            "dead": int(client.xlen(f"{p}:queue:work:dead")),
            "blobs": len(client.keys(f"{p}:blob:*")),
            "expiries": sum(
                int(client.zcard(k))
                for k in (f"{p}:queue:results:expiry", f"{p}:records:batch:expiry")
            ),
        }
    finally:
        client.close()


def test_results_records_blobs_and_dead_letters_expire(
    queue_factory: Callable[..., WorkQueue], request: pytest.FixtureRequest
) -> None:
    """Past `retention_s` a result, a dead letter, and a record or blob that named no expiry
    read as absent; a record or blob with its own later expiry stays; later writes reclaim
    the expired entries' space; a task whose result expired can store a new one."""

    async def main() -> None:
        async with queue_factory(retention_s=1.0, max_deliveries=1) as q:
            later = time.time() + 60
            await q.enqueue(tasks(2), results={"pre": {"x": 1}}, record=("batch", "b", {"n": 1}))
            await q.put_record("batch", "kept", {"n": 2}, expires_at=later)
            await q.put_blob("lapses", b"d")
            await q.put_blob("kept", b"k", expires_at=later)
            first, second = await q.claim("c", max_tasks=2)
            assert await q.complete(first, {"out": 0}) is True
            assert await q.fail(second, "boom") is True  # its last delivery: dead-lettered
            ids = ["pre", "t0", "t1"]
            dead = {"error": {"code": "dead_letter", "message": "boom"}}
            assert await q.results(ids) == [{"x": 1}, {"out": 0}, dead]
            assert [d.task_id for d in await q.dead_letters()] == ["t1"]
            assert sorted(r["n"] for r in await q.list_records("batch")) == [1, 2]
            assert await q.get_blob("lapses") == b"d"

            await asyncio.sleep(1.3)
            assert await q.results(ids) == [None, None, None]
            assert await q.dead_letters() == []
            assert await q.get_record("batch", "b") is None
            assert await q.list_records("batch") == [{"n": 2}]
            assert await q.get_record("batch", "kept") == {"n": 2}
            assert await q.delete_record("batch", "b") is False  # expired: nothing to delete
            assert (await q.get_blob("lapses"), await q.get_blob("kept")) == (None, b"k")
            # A write reclaims what expired (a few per write); a new result may be stored.
            await q.enqueue([], results={"pre": {"x": 2}})
            assert await q.results(ids) == [{"x": 2}, None, None]
            await q.enqueue([Task("t2", "echo", {})])
            [third] = await q.claim("c")
            assert await q.fail(third, "again") is True  # a new burial trims the old one
            assert [d.reason for d in await q.dead_letters()] == ["again"]
            counts = stored_counts(q, request)
            # Left: "pre"'s and t2's results, the "kept" record, t2's dead letter, "kept"'s
            # blob, and the expiries of the results and the record (SQLite's table also
            # holds the dead letter's and the blob's; Redis trims the one, expires the other).
            sqlite = isinstance(q, SqliteWorkQueue)
            assert counts == {"results": 2, "records": 1, "dead": 1, "blobs": 1,
                              "expiries": 5 if sqlite else 3}  # fmt: skip

    asyncio.run(main())


def test_named_queues_are_independent(queue_factory: Callable[..., WorkQueue]) -> None:
    """Tasks of one queue never wait behind another's; results and records are shared."""

    async def main() -> None:
        async with queue_factory() as work:
            other = work.queue_named("background")
            await work.enqueue(tasks(3))
            await other.enqueue([Task("bg", "chat", {})])
            assert (await work.num_pending(), await other.num_pending()) == (3, 1)
            [d] = await other.claim("c", max_tasks=5)
            assert d.task_id == "bg"
            assert await other.fail(d, "x") is False
            [d] = await other.claim("c")
            assert await other.complete(d, {"ok": 1})
            assert await work.results(["bg"]) == [{"ok": 1}]
            assert [t.task_id for t in await work.claim("c", max_tasks=5)] == ["t0", "t1", "t2"]
            assert await other.dead_letters() == [] and await other.num_pending() == 0

    asyncio.run(main())


def test_bad_limits_and_urls_are_named() -> None:
    with pytest.raises(ValueError, match="lease_s: must be > 0"):
        SqliteWorkQueue(":memory:", lease_s=0)
    with pytest.raises(ValueError, match="max_deliveries: must be >= 1"):
        SqliteWorkQueue(":memory:", max_deliveries=0)
    with pytest.raises(ValueError, match="--queue-url: unsupported scheme 'kafka'"):
        open_work_queue("kafka://broker:9092")


def test_acknowledged_results_survive_a_redis_kill(
    make_redis_server: Callable[[], RedisServer],
) -> None:
    """AOF with fsync always: a result stored (and its task acknowledged) before SIGKILL is
    there after the restart, and the unacknowledged task is still pending."""
    server = make_redis_server()

    async def before() -> None:
        async with RedisWorkQueue.from_url(server.url, lease_s=LEASE_S) as q:
            await q.enqueue(tasks(2))
            [d] = await q.claim("c1")
            assert await q.complete(d, {"ok": True})

    async def after() -> None:
        async with RedisWorkQueue.from_url(server.url, lease_s=LEASE_S) as q:
            assert await q.results(["t0"]) == [{"ok": True}]
            assert await q.num_pending() == 1
            [d] = await q.claim("c2")
            assert d.task_id == "t1"

    asyncio.run(before())
    server.kill()
    server.start()
    asyncio.run(after())


def test_an_expired_lease_far_down_the_pending_list_is_found(
    redis_server: RedisServer,
) -> None:
    """XAUTOCLAIM scans a bounded stretch of the pending list per call: with 50 live leases
    ahead of it, a dead router's task is still taken over (the scan carries its cursor)."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"

    async def main() -> None:
        async with RedisWorkQueue.from_url(redis_server.url, key_prefix=prefix, lease_s=0.5) as q:
            await q.enqueue(tasks(51))
            live = await q.claim("live", max_tasks=50)
            [doomed] = await q.claim("dead")
            assert doomed.task_id == "t50"
            deadline = asyncio.get_running_loop().time() + 10
            taken: list[Delivery] = []
            while not taken:
                assert asyncio.get_running_loop().time() < deadline, "t50 never taken over"
                for d in live:  # the live router keeps its 50 leases
                    assert await q.renew(d)
                taken = await q.claim("survivor", max_tasks=1)
                await asyncio.sleep(0.02)
            assert [(d.task_id, d.num_deliveries) for d in taken] == [("t50", 2)]

    asyncio.run(main())
