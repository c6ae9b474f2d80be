"""Fixtures: a real redis-server on a free port, and one factory per backend for the contract."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis

from duet.session_store import (
    InProcessRateLimiter,
    RateLimiter,
    RedisRateLimiter,
    RedisSessionStore,
    SessionStore,
    SqliteSessionStore,
)
from tests.net import free_port
from tests.waiting import wait_for

T = TypeVar("T")
S = TypeVar("S", SessionStore, RateLimiter)


class RedisServer:
    """A redis-server child process with AOF on; restartable on the same port and directory."""

    def __init__(self, workdir: Path, port: int) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed; `make test` installs it (apt redis-server)")
        self.binary = binary
        self.workdir = workdir
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        assert self.proc is None, "already running"
        # NOTE: appendfsync always, so a SIGKILL loses no acknowledged write.
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--logfile", str(self.workdir / "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc = self.proc
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)

        def answers() -> bool:
            if proc.poll() is not None:
                self.proc = None
                pytest.fail(f"redis-server exited at start:\n{self.log()}")
            try:
                return bool(client.ping())
            except redis.exceptions.RedisError:
                return False

        try:
            wait_for(answers, timeout_s, "redis-server to answer PING", 0.02)
        except AssertionError as e:
            self.kill()
            pytest.fail(f"{e}:\n{self.log()}")
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: no chance to save anything beyond what the AOF already holds."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self.proc = None

    def log(self) -> str:
        path = self.workdir / "redis.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else "(no log)"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), free_port())
    server.start()
    yield server
    server.stop()


def _run_with(factory: Callable[[], S], body: Callable[[S], Awaitable[T]]) -> T:
    """Build the store (or limiter) inside a fresh event loop, run `body`, always close it."""

    async def main() -> T:
        backend = factory()
        try:
            return await body(backend)
        finally:
            await backend.close()

    return asyncio.run(main())


@pytest.fixture
def run() -> Callable[..., object]:
    """`run(factory, body)`: await `body(backend)` in a fresh event loop, then close it."""
    return _run_with


@pytest.fixture
def make_redis_server(tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    """Start private redis-servers (for tests that kill them); all stopped at teardown."""
    servers: list[RedisServer] = []

    def make() -> RedisServer:
        workdir = tmp_path / f"redis-{len(servers)}"
        workdir.mkdir()
        server = RedisServer(workdir, free_port())
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(params=["sqlite", "redis"])
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], SessionStore]:
    """A factory for a fresh, empty store of each backend."""
    if request.param == "sqlite":
        return lambda: SqliteSessionStore(tmp_path / "sessions.db")
    server: RedisServer = request.getfixturevalue("redis_server")
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    return lambda: RedisSessionStore.from_url(server.url, key_prefix=prefix)


@pytest.fixture(params=["in_process", "redis"])
def limiter_factory(request: pytest.FixtureRequest) -> Callable[[], RateLimiter]:
    """A factory for a fresh rate limiter of each backend."""
    if request.param == "in_process":
        return InProcessRateLimiter
    server: RedisServer = request.getfixturevalue("redis_server")
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    return lambda: RedisRateLimiter.from_url(server.url, key_prefix=prefix)
