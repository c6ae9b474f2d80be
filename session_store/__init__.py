"""duet: session_store: conversation state and rate-limit counters.

`open_session_store(url)` and `open_rate_limiter(url)` pick the backend from the
`--session-store` URL:

    (no URL)                  embedded: SQLite at $XDG_DATA_HOME/duet/sessions.db (or
                              ~/.local/share/duet/sessions.db); in-process rate limits
    sqlite:///relative.db     embedded, at a path relative to the working directory
    sqlite:////abs/path.db    embedded, at an absolute path (SQLAlchemy's convention)
    redis://host:6379/0       Redis (also rediss:// for TLS, unix:///path/to/redis.sock)

`open_work_queue(url)` gives the durable work queue (session_store/work_queue.py) in the same
backend: Redis Streams, or tables in the same SQLite file.

Both factories are synchronous and connect lazily, on first use, in the caller's event loop.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from duet.session_store.base import (
    DEFAULT_SESSION_TTL_S,
    RateDecision,
    RateLimiter,
    RateLimits,
    Session,
    SessionConflict,
    SessionNotFound,
    SessionStore,
    SessionStoreError,
    SessionStoreUnavailable,
    StoredResponse,
    hash_api_key,
)
from duet.session_store.redis_queue import RedisWorkQueue
from duet.session_store.redis_rate_limiter import RedisRateLimiter
from duet.session_store.redis_store import RedisSessionStore
from duet.session_store.sqlite_queue import SqliteWorkQueue
from duet.session_store.sqlite_store import SqliteSessionStore, default_sqlite_path
from duet.session_store.token_bucket import InProcessRateLimiter
from duet.session_store.work_queue import (
    DEFAULT_EVENT_TTL_S,
    DEFAULT_LEASE_S,
    DEFAULT_MAX_DELIVERIES,
    DEFAULT_RETENTION_S,
    DeadLetter,
    Delivery,
    Task,
    WorkQueue,
)

__all__ = [
    "DEFAULT_EVENT_TTL_S",
    "DEFAULT_LEASE_S",
    "DEFAULT_MAX_DELIVERIES",
    "DEFAULT_RETENTION_S",
    "DEFAULT_SESSION_TTL_S",
    "DeadLetter",
    "Delivery",
    "InProcessRateLimiter",
    "RateDecision",
    "RateLimiter",
    "RateLimits",
    "RedisRateLimiter",
    "RedisSessionStore",
    "RedisWorkQueue",
    "Session",
    "SessionConflict",
    "SessionNotFound",
    "SessionStore",
    "SessionStoreError",
    "SessionStoreUnavailable",
    "SqliteSessionStore",
    "SqliteWorkQueue",
    "StoredResponse",
    "Task",
    "WorkQueue",
    "check_store_url",
    "default_sqlite_path",
    "hash_api_key",
    "open_rate_limiter",
    "open_session_store",
    "open_work_queue",
]

_REDIS_SCHEMES = ("redis", "rediss", "unix")
_ACCEPTED = (
    "redis://host:port/db, rediss://host:port/db, unix:///path/to/redis.sock, "
    "sqlite:///relative/path.db or sqlite:////absolute/path.db "
    "(or no --session-store for the embedded default)"
)


def _parse(url: str, flag: str = "--session-store") -> tuple[str, Path | None]:
    """("redis", None) or ("sqlite", path); ValueError naming the flag otherwise."""
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    if scheme in _REDIS_SCHEMES:
        return "redis", None
    if scheme == "sqlite":
        prefix = "sqlite:///"
        path = url[len(prefix) :] if url[: len(prefix)].lower() == prefix else ""
        if not path:
            raise ValueError(f"{flag}: sqlite URL has no path; expected {_ACCEPTED}")
        return "sqlite", Path(path).expanduser()
    # NOTE: echo only the scheme: the URL may carry a password.
    shown = f"scheme {scheme!r}" if scheme else "a value that is not a URL"
    raise ValueError(f"{flag}: unsupported {shown}; expected {_ACCEPTED}")


def check_store_url(url: str, flag: str) -> None:
    """ValueError naming `flag` unless `url` is a Redis or SQLite URL this package opens."""
    _parse(url, flag)


def open_session_store(url: str | None) -> SessionStore:
    """The session store for a `--session-store` URL; None means the embedded SQLite file."""
    if url is None:
        return SqliteSessionStore()
    kind, path = _parse(url)
    if kind == "redis":
        return RedisSessionStore.from_url(url)
    return SqliteSessionStore(path)


def open_rate_limiter(url: str | None) -> RateLimiter:
    """The rate limiter for a `--session-store` URL: Redis buckets, else in-process ones.

    The embedded backend keeps buckets in the router process: one router per machine needs
    nothing more, and a restart simply refills them.
    """
    if url is None:
        return InProcessRateLimiter()
    kind, _ = _parse(url)
    if kind == "redis":
        return RedisRateLimiter.from_url(url)
    return InProcessRateLimiter()


def open_work_queue(
    url: str | None,
    *,
    lease_s: float = DEFAULT_LEASE_S,
    max_deliveries: int = DEFAULT_MAX_DELIVERIES,
    event_ttl_s: float = DEFAULT_EVENT_TTL_S,
    retention_s: float = DEFAULT_RETENTION_S,
    flag: str = "--queue-url",
) -> WorkQueue:
    """The work queue for a `--queue-url` (or, without one, the `--session-store` URL): Redis
    Streams, else tables in the SQLite file (None: the embedded default file)."""
    kind, path = ("sqlite", None) if url is None else _parse(url, flag)
    if kind == "redis":
        assert url is not None
        return RedisWorkQueue.from_url(
            url, lease_s=lease_s, max_deliveries=max_deliveries, event_ttl_s=event_ttl_s,
            retention_s=retention_s,
        )  # fmt: skip
    return SqliteWorkQueue(
        path, lease_s=lease_s, max_deliveries=max_deliveries, event_ttl_s=event_ttl_s,
        retention_s=retention_s,
    )  # fmt: skip
