"""Per-API-key rate limits, checked when a generation request is admitted.

Each key has two token buckets: requests per minute and tokens per minute. A request costs one
request plus its token estimate: its prompt tokens and the most it may generate (max_tokens for
each of its `n` samples), both known before it runs. The buckets live in the session store's
backend (`session_store.open_rate_limiter`): with Redis, every router replica shares them.
Without API keys configured, every caller shares the bucket of the key `"anonymous"`.

The limiter fails open: when its backend is down, requests are admitted unchecked (and the
backend is left alone for `skip_after_failure_s`, so a hung Redis does not add its timeout to
every request). A Redis outage must not stop requests that need no session.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from duet.router.errors import RateLimitError
from duet.session_store import RateLimiter, RateLimits, SessionStoreUnavailable

logger = logging.getLogger(__name__)

ANONYMOUS_KEY = "anonymous"
"""The rate-limit key of callers when the server has no API keys."""
NO_RATE_LIMITS = RateLimits()


class RequestRateLimiter:
    """Applies `limits` per API key through `limiter`. Only the event loop's thread calls it."""

    def __init__(
        self,
        limiter: RateLimiter | None,
        limits: RateLimits,
        *,
        skip_after_failure_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not limits.is_unlimited and limiter is None:
            raise ValueError("rate limits need a RateLimiter (see session_store.open_rate_limiter)")
        self._limiter = limiter
        self.limits = limits
        self._skip_after_failure_s = skip_after_failure_s
        self._clock = clock
        self._skip_until = -math.inf

    @property
    def enabled(self) -> bool:
        return not self.limits.is_unlimited

    async def admit(self, api_key: str | None, num_tokens: int) -> None:
        """Take one request and `num_tokens` from the caller's buckets, or raise
        `RateLimitError` (429, Retry-After in whole seconds) taking nothing."""
        if self._limiter is None or self.limits.is_unlimited:
            return
        now = self._clock()
        if now < self._skip_until:
            return
        try:
            decision = await self._limiter.acquire(
                api_key or ANONYMOUS_KEY, 1, num_tokens, self.limits
            )
        except SessionStoreUnavailable as e:
            logger.warning(
                "rate limiter unavailable (%s): admitting requests unchecked for %.0fs",
                e, self._skip_after_failure_s,
            )  # fmt: skip
            self._skip_until = now + self._skip_after_failure_s
            return
        if decision.allowed:
            return
        retry_after_s = max(1, math.ceil(decision.retry_after_s))
        raise RateLimitError(
            f"rate limit reached for this API key ({self._describe()}; this request counts "
            f"{num_tokens} tokens: prompt + max_tokens); retry after {retry_after_s}s",
            retry_after_s=retry_after_s,
        )

    def _describe(self) -> str:
        parts = []
        if self.limits.requests_per_min is not None:
            parts.append(f"{self.limits.requests_per_min:g} requests/min")
        if self.limits.tokens_per_min is not None:
            parts.append(f"{self.limits.tokens_per_min:g} tokens/min")
        return ", ".join(parts)
