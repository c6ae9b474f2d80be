"""The shared `RateLimiter`: token buckets in Redis, one set for all router replicas.

Key layout (see also `redis_store.py`):

    <prefix>:ratelimit:<sha256(key)>   hash   req_level, req_ts, tok_level, tok_ts
                                              (level may be negative: debt; ts in unix
                                              seconds by the Redis clock)

One Lua script refills, decides and takes from both buckets atomically, by Redis's clock, so
replicas with skewed clocks agree. The hash expires once both buckets would be full again (a
missing bucket reads as full). The arithmetic mirrors `token_bucket.py`.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from duet.session_store.base import (
    RateDecision,
    RateLimiter,
    RateLimits,
    hash_api_key,
    validate_acquire,
)
from duet.session_store.redis_client import RedisGuard, connect_redis

# KEYS: bucket hash. ARGV: request cost, requests/min ('' = unlimited), token cost, tokens/min.
# Returns {1, '0'} when taken, {0, retry_after_s} when refused (nothing taken).
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local names = {'req', 'tok'}
local levels = {}
local retry = 0
for i = 1, 2 do
  if ARGV[2 * i] ~= '' then
    local cost, per_min = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
    local state = redis.call('HMGET', KEYS[1], names[i] .. '_level', names[i] .. '_ts')
    local level = per_min
    if state[1] then
      local elapsed = math.max(0, now - tonumber(state[2]))
      level = math.min(per_min, tonumber(state[1]) + elapsed * per_min / 60)
    end
    levels[i] = level
    local need = math.min(cost, per_min)
    if level < need then retry = math.max(retry, (need - level) * 60 / per_min) end
  end
end
if retry > 0 then return {0, string.format('%.6f', retry)} end
local full_in_s = 0
for i = 1, 2 do
  if levels[i] then
    local cost, per_min = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
    local level = levels[i] - cost
    redis.call('HSET', KEYS[1], names[i] .. '_level', string.format('%.17g', level),
               names[i] .. '_ts', string.format('%.6f', now))
    full_in_s = math.max(full_in_s, (per_min - level) * 60 / per_min)
  end
end
redis.call('PEXPIRE', KEYS[1], math.ceil(full_in_s * 1000) + 1000)
return {1, '0'}
"""

# A refusal always says to wait a little, even when the shortfall rounds to nothing.
_MIN_RETRY_AFTER_S = 0.001


def _per_min_arg(per_min: float | None) -> str:
    return "" if per_min is None else repr(float(per_min))


class RedisRateLimiter(RateLimiter):
    """Token buckets in Redis; survives Redis restarts like `RedisSessionStore`."""

    def __init__(
        self, client: aioredis.Redis, *, key_prefix: str = "duet", op_timeout_s: float = 2.5
    ) -> None:
        self._client = client
        self._guard = RedisGuard("rate limiter", op_timeout_s)
        self.key_prefix = key_prefix
        self._acquire = client.register_script(_ACQUIRE)

    @classmethod
    def from_url(
        cls, url: str, *, key_prefix: str = "duet", op_timeout_s: float = 2.5
    ) -> RedisRateLimiter:
        return cls(connect_redis(url), key_prefix=key_prefix, op_timeout_s=op_timeout_s)

    async def acquire(
        self, key: str, requests: int, tokens: int, limits: RateLimits
    ) -> RateDecision:
        validate_acquire(requests, tokens)
        if limits.is_unlimited:
            return RateDecision(allowed=True)
        allowed, retry_after = await self._guard.run(
            "acquire",
            self._acquire(
                keys=[f"{self.key_prefix}:ratelimit:{hash_api_key(key)}"],
                args=[
                    str(requests),
                    _per_min_arg(limits.requests_per_min),
                    str(tokens),
                    _per_min_arg(limits.tokens_per_min),
                ],
            ),
        )
        if allowed:
            return RateDecision(allowed=True)
        return RateDecision(
            allowed=False, retry_after_s=max(_MIN_RETRY_AFTER_S, float(retry_after))
        )

    async def close(self) -> None:
        await self._client.aclose()
