"""duet: session_store: conversation state and rate-limit counters.

`open_session_store(url)` and `open_rate_limiter(url)` pick the backend from the
`--session-store` URL:

    (no URL)                  embedded: SQLite at $XDG_DATA_HOME/duet/sessions.db (or
                              ~/.local/share/duet/sessions.db); in-process rate limits
    sqlite:///relative.db     embedded, at a path relative to the working directory
    sqlite:////abs/path.db    embedded, at an absolute path (SQLAlchemy's convention)
    redis://host:6379/0       Redis (also rediss:// for TLS, unix:///path/to/redis.sock)

Both factories are synchronous and connect lazily, on first use, in the caller's event loop.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from session_store.base import (
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
    hash_api_key,
)
from session_store.redis_rate_limiter import RedisRateLimiter
from session_store.redis_store import RedisSessionStore
from session_store.sqlite_store import SqliteSessionStore, default_sqlite_path
from session_store.token_bucket import InProcessRateLimiter

__all__ = [
    "DEFAULT_SESSION_TTL_S",
    "InProcessRateLimiter",
    "RateDecision",
    "RateLimiter",
    "RateLimits",
    "RedisRateLimiter",
    "RedisSessionStore",
    "Session",
    "SessionConflict",
    "SessionNotFound",
    "SessionStore",
    "SessionStoreError",
    "SessionStoreUnavailable",
    "SqliteSessionStore",
    "default_sqlite_path",
    "hash_api_key",
    "open_rate_limiter",
    "open_session_store",
]

_REDIS_SCHEMES = ("redis", "rediss", "unix")
_ACCEPTED = (
    "redis://host:port/db, rediss://host:port/db, unix:///path/to/redis.sock, "
    "sqlite:///relative/path.db or sqlite:////absolute/path.db "
    "(or no --session-store for the embedded default)"
)


def _parse(url: str) -> tuple[str, Path | None]:
    """("redis", None) or ("sqlite", path); ValueError naming the flag otherwise."""
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    if scheme in _REDIS_SCHEMES:
        return "redis", None
    if scheme == "sqlite":
        prefix = "sqlite:///"
        path = url[len(prefix) :] if url[: len(prefix)].lower() == prefix else ""
        if not path:
            raise ValueError(f"--session-store: sqlite URL has no path; expected {_ACCEPTED}")
        return "sqlite", Path(path).expanduser()
    # NOTE: echo only the scheme: the URL may carry a password.
    shown = f"scheme {scheme!r}" if scheme else "a value that is not a URL"
    raise ValueError(f"--session-store: unsupported {shown}; expected {_ACCEPTED}")


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
