"""One way to build a Redis client for duet, and one way to bound and classify its failures.

The client fails fast and heals itself: short socket timeouts, a small retry budget that
reconnects (so the first command after a Redis restart succeeds on a fresh connection), and
an outer deadline per operation that turns anything slow or down into
`SessionStoreUnavailable`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from duet.session_store.base import SessionStoreUnavailable

T = TypeVar("T")

# Errors that mean "the backend is not answering properly right now", never a bug of ours.
# BusyLoadingError (Redis still loading its AOF after a restart) is a ConnectionError.
_UNAVAILABLE = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.ReadOnlyError,  # a replica promoted mid-failover
    redis_errors.TryAgainError,
    OSError,
)


def connect_redis(
    url: str,
    *,
    socket_timeout_s: float = 1.5,
    connect_timeout_s: float = 1.0,
    num_retries: int = 1,
    health_check_interval_s: int = 15,
) -> aioredis.Redis:
    """A client for `url` (redis://, rediss:// or unix://) that decodes replies as str.

    No connection is made here; the pool connects lazily on the first command, in the event
    loop that issues it.
    """
    return aioredis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        # NOTE: retries multiply (the connect inside a command retries too), so keep it small;
        # one retry is what lets a pooled connection that died with a restart reconnect.
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.2), num_retries),
        health_check_interval=health_check_interval_s,
        client_name="duet",
    )


class RedisGuard:
    """Runs one Redis operation under a deadline, mapping outages to `SessionStoreUnavailable`."""

    def __init__(self, what: str, op_timeout_s: float) -> None:
        self.what = what
        self.op_timeout_s = op_timeout_s

    async def run(self, op: str, awaitable: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(self.op_timeout_s):
                return await awaitable
        except TimeoutError as e:
            raise SessionStoreUnavailable(
                f"{self.what} {op} timed out after {self.op_timeout_s}s (Redis)"
            ) from e
        except _UNAVAILABLE as e:
            raise SessionStoreUnavailable(f"{self.what} {op} failed (Redis): {e}") from e
