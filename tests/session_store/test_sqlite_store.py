"""The embedded backend: survives restarts, serializes writers across stores, sweeps, fails fast."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from duet.session_store import (
    SessionNotFound,
    SessionStoreUnavailable,
    SqliteSessionStore,
    default_sqlite_path,
)

pytestmark = pytest.mark.timeout(60)


def turn(i: int) -> list[dict]:
    return [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]


def test_history_survives_reopening_the_file(tmp_path: Path):
    path = tmp_path / "nested" / "sessions.db"

    async def first() -> str:
        async with SqliteSessionStore(path) as store:
            session = await store.create("sk-alice", metadata={"title": "t"})
            await store.append_turn(session.id, turn(0))
            await store.append_turn(session.id, turn(1))
            return session.id

    async def second(session_id: str) -> None:
        async with SqliteSessionStore(path) as store:
            assert await store.history(session_id) == turn(0) + turn(1)
            got = await store.get(session_id)
            assert (got.version, got.num_messages, got.metadata) == (2, 4, {"title": "t"})
            assert await store.append_turn(session_id, turn(2)) == 3

    session_id = asyncio.run(first())
    asyncio.run(second(session_id))


def test_two_stores_on_one_file_serialize_their_turns(tmp_path: Path):
    path = tmp_path / "sessions.db"

    async def body() -> None:
        a, b = SqliteSessionStore(path), SqliteSessionStore(path)
        try:
            session = await a.create("sk-alice")
            await asyncio.gather(
                *((a if i % 2 else b).append_turn(session.id, turn(i)) for i in range(20))
            )
            history = await b.history(session.id)
            assert len(history) == 40
            assert all(
                history[i]["content"][1:] == history[i + 1]["content"][1:] for i in range(0, 40, 2)
            )
            assert sorted(int(m["content"][1:]) for m in history[::2]) == list(range(20))
            assert (await a.get(session.id)).version == 20
        finally:
            await a.close()
            await b.close()

    asyncio.run(body())


def test_raw_api_key_never_reaches_disk(tmp_path: Path):
    async def body() -> None:
        async with SqliteSessionStore(tmp_path / "sessions.db") as store:
            session = await store.create("sk-very-secret-key-123")
            await store.append_turn(session.id, turn(0))

    asyncio.run(body())
    files = list(tmp_path.iterdir())
    assert files
    for file in files:
        assert b"sk-very-secret-key-123" not in file.read_bytes()


def test_expired_rows_are_swept_lazily(tmp_path: Path):
    now = [1_000_000.0]
    path = tmp_path / "sessions.db"

    async def body() -> None:
        store = SqliteSessionStore(path, sweep_interval_s=60, clock=lambda: now[0])
        async with store:
            old = await store.create("sk-a", ttl_s=10)
            await store.append_turn(old.id, turn(0))
            now[0] += 11
            with pytest.raises(SessionNotFound):
                await store.get(old.id)  # expired rows read as missing before any sweep
            now[0] += 60
            await store.create("sk-a", ttl_s=10)  # this write runs the sweep

    asyncio.run(body())
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM sessions").fetchone() == (1,)
        assert conn.execute("SELECT COUNT(*) FROM messages").fetchone() == (0,)


def test_locked_database_is_unavailable_not_a_hang(tmp_path: Path):
    path = tmp_path / "sessions.db"

    async def body() -> None:
        async with SqliteSessionStore(path, busy_timeout_s=0.2) as store:
            session = await store.create("sk-a")
            blocker = sqlite3.connect(path, isolation_level=None)
            blocker.execute("BEGIN IMMEDIATE")
            try:
                started = time.monotonic()
                with pytest.raises(SessionStoreUnavailable, match="locked"):
                    await store.append_turn(session.id, turn(0))
                assert time.monotonic() - started < 2.0
                assert await store.history(session.id) == []  # readers are not blocked (WAL)
            finally:
                blocker.execute("ROLLBACK")
                blocker.close()
            assert await store.append_turn(session.id, turn(0)) == 1

    asyncio.run(body())


def test_default_path_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_sqlite_path() == tmp_path / "xdg" / "duet" / "sessions.db"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_sqlite_path() == tmp_path / "home" / ".local" / "share" / "duet" / "sessions.db"


def test_closed_store_refuses_calls(tmp_path: Path):
    async def body() -> None:
        store = SqliteSessionStore(tmp_path / "sessions.db")
        await store.close()
        await store.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            await store.create("sk-a")

    asyncio.run(body())
