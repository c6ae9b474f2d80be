"""Token-bucket arithmetic and the in-process `RateLimiter` of the embedded backend.

`redis_rate_limiter.py` runs the same arithmetic in Lua; keep the two in step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from duet.session_store.base import (
    RateDecision,
    RateLimiter,
    RateLimits,
    hash_api_key,
    validate_acquire,
)

# NOTE: idle buckets are dropped once full again (they read as full when missing), swept at
# most this often so a busy router does not scan its dict on every request.
_SWEEP_INTERVAL_S = 60.0


@dataclass
class Bucket:
    """One token bucket: its level at `updated_at` (may be negative: debt)."""

    level: float
    updated_at: float


def refill(bucket: Bucket | None, per_min: float, now: float) -> float:
    """The bucket's level at `now`; a missing bucket is full (one minute's worth)."""
    if bucket is None:
        return per_min
    elapsed_s = max(0.0, now - bucket.updated_at)
    return min(per_min, bucket.level + elapsed_s * per_min / 60.0)


def wait_s(level: float, cost: float, per_min: float) -> float:
    """Seconds until `cost` fits; a cost above the bucket size needs a full bucket."""
    need = min(cost, per_min)
    return 0.0 if level >= need else (need - level) * 60.0 / per_min


def full_at(bucket: Bucket, per_min: float) -> float:
    """When this bucket is full again, after which it may be forgotten."""
    return bucket.updated_at + max(0.0, per_min - bucket.level) * 60.0 / per_min


class InProcessRateLimiter(RateLimiter):
    """Buckets in a dict: for one router process (the embedded, single-machine setup).

    Not shared between processes and lost on restart (a restart refills every bucket). Never
    blocks and never raises `SessionStoreUnavailable`.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # key hash -> ((requests bucket, tokens bucket), when both are full again)
        self._buckets: dict[str, tuple[tuple[Bucket | None, Bucket | None], float]] = {}
        self._last_sweep = clock()

    @property
    def num_keys(self) -> int:
        """Keys whose buckets are not known to be full."""
        return len(self._buckets)

    async def acquire(
        self, key: str, requests: int, tokens: int, limits: RateLimits
    ) -> RateDecision:
        validate_acquire(requests, tokens)
        if limits.is_unlimited:
            return RateDecision(allowed=True)
        now = self._clock()
        key_hash = hash_api_key(key)
        assert key_hash is not None
        old, _ = self._buckets.get(key_hash, ((None, None), now))
        costs = (requests, tokens)
        per_mins = (limits.requests_per_min, limits.tokens_per_min)
        levels: list[float | None] = []
        retry_after_s = 0.0
        for bucket, cost, per_min in zip(old, costs, per_mins, strict=True):
            if per_min is None:
                levels.append(None)
                continue
            level = refill(bucket, per_min, now)
            levels.append(level)
            retry_after_s = max(retry_after_s, wait_s(level, cost, per_min))
        if retry_after_s > 0:
            return RateDecision(allowed=False, retry_after_s=retry_after_s)
        new = [
            None if lv is None else Bucket(lv - c, now) for lv, c in zip(levels, costs, strict=True)
        ]
        all_full_at = max(
            (full_at(b, pm) for b, pm in zip(new, per_mins, strict=True) if b and pm), default=now
        )
        self._buckets[key_hash] = ((new[0], new[1]), all_full_at)
        self._maybe_sweep(now)
        return RateDecision(allowed=True)

    def _maybe_sweep(self, now: float) -> None:
        if now - self._last_sweep < _SWEEP_INTERVAL_S:
            return
        self._last_sweep = now
        for key_hash in [k for k, (_, at) in self._buckets.items() if at <= now]:
            del self._buckets[key_hash]

    async def close(self) -> None:
        self._buckets.clear()
