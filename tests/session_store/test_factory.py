"""`--session-store` URLs: which backend each one opens, and the error for the rest."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from duet.session_store import (
    InProcessRateLimiter,
    RedisRateLimiter,
    RedisSessionStore,
    SqliteSessionStore,
    open_rate_limiter,
    open_session_store,
)


def close(backend) -> None:
    asyncio.run(backend.close())


def test_no_url_opens_the_embedded_store_under_xdg_data_home(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    store = open_session_store(None)
    assert isinstance(store, SqliteSessionStore)
    assert store.path == tmp_path / "duet" / "sessions.db"

    async def body() -> None:
        async with store:
            await store.create(None)

    asyncio.run(body())
    assert store.path.is_file()
    limiter = open_rate_limiter(None)
    assert isinstance(limiter, InProcessRateLimiter)


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("sqlite:///sessions.db", Path("sessions.db")),
        ("sqlite:////var/lib/duet/s.db", Path("/var/lib/duet/s.db")),
        ("SQLITE:///rel/dir/s.db", Path("rel/dir/s.db")),
    ],
)
def test_sqlite_urls(url: str, path: Path):
    store = open_session_store(url)
    assert isinstance(store, SqliteSessionStore) and store.path == path
    close(store)
    assert isinstance(open_rate_limiter(url), InProcessRateLimiter)


@pytest.mark.parametrize(
    "url", ["redis://localhost:6379/0", "rediss://:pw@cache:6380/1", "unix:///run/redis.sock"]
)
def test_redis_urls(url: str):
    store = open_session_store(url)  # connects lazily: nothing listens there
    assert isinstance(store, RedisSessionStore)
    close(store)
    limiter = open_rate_limiter(url)
    assert isinstance(limiter, RedisRateLimiter)
    close(limiter)


@pytest.mark.parametrize(
    "url", ["postgres://user:hunter2@db/x", "http://cache", "sessions.db", "sqlite://", "", "mem"]
)
def test_unsupported_urls_name_the_flag_and_the_schemes(url: str):
    for factory in (open_session_store, open_rate_limiter):
        with pytest.raises(ValueError) as info:
            factory(url)
        message = str(info.value)
        assert message.startswith("--session-store:")
        for scheme in ("redis://", "rediss://", "unix://", "sqlite:///"):
            assert scheme in message
        assert "hunter2" not in message
