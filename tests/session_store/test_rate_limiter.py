"""The RateLimiter contract against the in-process and Redis buckets, plus exact bucket math."""

from __future__ import annotations

import asyncio

import pytest

from duet.session_store import InProcessRateLimiter, RateLimiter, RateLimits

pytestmark = pytest.mark.timeout(60)


def test_allows_then_refuses_then_refills(limiter_factory, run):
    async def body(limiter: RateLimiter) -> None:
        limits = RateLimits(tokens_per_min=1200)  # 20 tokens/s, bucket of 1200
        first = await limiter.acquire("sk-a", 1, 1200, limits)
        assert first.allowed and first.retry_after_s == 0
        refused = await limiter.acquire("sk-a", 1, 10, limits)
        assert not refused.allowed
        assert 0 < refused.retry_after_s <= 0.5  # 10 tokens at 20/s, minus what refilled
        assert (await limiter.acquire("sk-b", 1, 10, limits)).allowed  # keys are independent
        await asyncio.sleep(refused.retry_after_s + 0.05)
        assert (await limiter.acquire("sk-a", 1, 10, limits)).allowed
        assert not (await limiter.acquire("sk-a", 1, 10, limits)).allowed

    run(limiter_factory, body)


def test_requests_per_minute(limiter_factory, run):
    async def body(limiter: RateLimiter) -> None:
        limits = RateLimits(requests_per_min=3, tokens_per_min=100_000)
        for _ in range(3):
            assert (await limiter.acquire("sk-a", 1, 100, limits)).allowed
        refused = await limiter.acquire("sk-a", 1, 100, limits)
        assert not refused.allowed
        assert 18.0 < refused.retry_after_s <= 20.0  # one request refills every 20 s

    run(limiter_factory, body)


def test_refusal_takes_nothing_from_either_bucket(limiter_factory, run):
    async def body(limiter: RateLimiter) -> None:
        limits = RateLimits(requests_per_min=2, tokens_per_min=1000)
        assert (await limiter.acquire("sk-a", 1, 900, limits)).allowed
        assert not (await limiter.acquire("sk-a", 1, 900, limits)).allowed  # tokens short
        # The refused call did not spend the second request.
        assert (await limiter.acquire("sk-a", 1, 0, limits)).allowed
        assert not (await limiter.acquire("sk-a", 1, 0, limits)).allowed

    run(limiter_factory, body)


def test_cost_above_bucket_size_is_admitted_once_and_leaves_debt(limiter_factory, run):
    async def body(limiter: RateLimiter) -> None:
        limits = RateLimits(tokens_per_min=60)  # 1 token/s
        assert (await limiter.acquire("sk-a", 1, 100, limits)).allowed
        refused = await limiter.acquire("sk-a", 1, 1, limits)
        assert not refused.allowed
        assert 39.0 < refused.retry_after_s <= 41.0  # from -40 tokens back up to 1

    run(limiter_factory, body)


def test_unlimited_and_validation(limiter_factory, run):
    async def body(limiter: RateLimiter) -> None:
        for _ in range(5):
            assert (await limiter.acquire("sk-a", 1, 10**9, RateLimits())).allowed
        with pytest.raises(ValueError, match="tokens must be >= 0"):
            await limiter.acquire("sk-a", 1, -1, RateLimits(tokens_per_min=10))
        with pytest.raises(ValueError, match="requests must be >= 0"):
            await limiter.acquire("sk-a", -1, 1, RateLimits(tokens_per_min=10))

    run(limiter_factory, body)
    with pytest.raises(ValueError, match=r"RateLimits.requests_per_min must be > 0"):
        RateLimits(requests_per_min=0)
    with pytest.raises(ValueError, match=r"RateLimits.tokens_per_min must be > 0"):
        RateLimits(tokens_per_min=float("inf"))


def test_in_process_bucket_math_with_a_fake_clock():
    now = [1000.0]
    limiter = InProcessRateLimiter(clock=lambda: now[0])
    limits = RateLimits(requests_per_min=60, tokens_per_min=600)  # 1 req/s, 10 tok/s

    async def body() -> None:
        assert (await limiter.acquire("sk-a", 60, 0, limits)).allowed
        decision = await limiter.acquire("sk-a", 2, 0, limits)
        assert (decision.allowed, decision.retry_after_s) == (False, 2.0)
        now[0] += 2.0
        assert (await limiter.acquire("sk-a", 2, 0, limits)).allowed
        assert (await limiter.acquire("sk-a", 0, 600, limits)).allowed
        decision = await limiter.acquire("sk-a", 1, 5, limits)
        assert (decision.allowed, decision.retry_after_s) == (False, 1.0)  # requests: 0 -> 1
        assert limiter.num_keys == 1
        now[0] += 3600.0  # idle buckets are forgotten by the next sweep
        assert (await limiter.acquire("sk-b", 1, 1, limits)).allowed
        assert limiter.num_keys == 1

    asyncio.run(body())
