"""Per-API-key rate limits: 429 with Retry-After in OpenAI's shape (REST) and
RESOURCE_EXHAUSTED (gRPC); requests/min and tokens/min; buckets shared by replicas on one
Redis; a down limiter backend admits requests instead of failing them."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import grpc
import openai
import pytest

from duet.engine import AsyncEngine
from duet.router.errors import RateLimitError
from duet.router.rate_limit import ANONYMOUS_KEY, RequestRateLimiter
from duet.session_store import (
    InProcessRateLimiter,
    RateDecision,
    RateLimiter,
    RateLimits,
    RedisRateLimiter,
    SessionStoreUnavailable,
)
from duet.v1 import serving_pb2
from tests.router.live_grpc import LiveGrpcServer
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, closing, make_app
from tests.session_store.conftest import RedisServer

OTHER_KEY = "sk-other-key"
USER = [{"role": "user", "content": "hi"}]


def _server(engine: AsyncEngine, limiter: RateLimiter, limits: RateLimits) -> LiveServer:
    app = make_app(
        engine,
        MODEL_NAME,
        api_keys=[API_KEY, OTHER_KEY],
        rate_limiter=limiter,
        rate_limits=limits,
        lifespan=closing(limiter),
    )
    return LiveServer(app).start()


def _client(live: LiveServer, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=30)


@pytest.fixture
def rpm2(rest_engine: AsyncEngine) -> Iterator[LiveServer]:
    live = _server(rest_engine, InProcessRateLimiter(), RateLimits(requests_per_min=2))
    yield live
    live.stop()


def test_rest_429_with_retry_after_after_the_rpm_per_key(rpm2: LiveServer) -> None:
    client = _client(rpm2)
    client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2)
    client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    for create in (
        lambda: client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2),
        lambda: client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, stream=True),
    ):
        with pytest.raises(openai.RateLimitError) as info:
            create()
        err = info.value
        assert err.status_code == 429
        assert (err.code, err.type) == ("rate_limit_exceeded", "rate_limit_error")
        assert "2 requests/min" in err.message
        # Two per minute: the next one fits in 30 s (rounded up to whole seconds).
        assert 1 <= int(err.response.headers["retry-after"]) <= 30
    # Buckets are per key.
    _client(rpm2, OTHER_KEY).chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2)


def test_tokens_per_min_counts_prompt_plus_max_tokens(rest_engine: AsyncEngine) -> None:
    live = _server(rest_engine, InProcessRateLimiter(), RateLimits(tokens_per_min=100))
    try:
        client = _client(live)
        client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=60)
        with pytest.raises(openai.RateLimitError) as info:  # ~10 prompt + 60 > the 30 left
            client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=60)
        assert "100 tokens/min" in info.value.message
        # A request that fits what is left is still admitted.
        client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=1)
    finally:
        live.stop()


def test_replicas_on_one_redis_share_the_buckets(
    rest_engine: AsyncEngine, redis_server: RedisServer
) -> None:
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    limits = RateLimits(requests_per_min=2)
    replicas = [
        _server(rest_engine, RedisRateLimiter.from_url(redis_server.url, key_prefix=prefix), limits)
        for _ in range(2)
    ]
    try:
        a, b = (_client(r) for r in replicas)
        a.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
        b.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
        for client in (a, b):
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    finally:
        for replica in replicas:
            replica.stop()


def test_grpc_resource_exhausted_after_the_rpm(rest_engine: AsyncEngine) -> None:
    limiter = InProcessRateLimiter()
    live = LiveGrpcServer(
        rest_engine, (limiter,), rate_limiter=limiter, rate_limits=RateLimits(requests_per_min=1)
    )
    try:
        request = serving_pb2.GenerateRequest(
            text="hi", sampling=serving_pb2.SamplingOptions(max_tokens=2)
        )
        assert list(live.stub.Generate(request, timeout=30))
        with pytest.raises(grpc.RpcError) as info:
            list(live.stub.Generate(request, timeout=30))
        err = info.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 requests/min" in err.details()
        assert 1 <= int(dict(err.trailing_metadata())["retry-after"]) <= 60
    finally:
        live.stop()


class _DownLimiter(RateLimiter):
    def __init__(self) -> None:
        self.num_calls = 0

    async def acquire(
        self, key: str, requests: int, tokens: int, limits: RateLimits
    ) -> RateDecision:
        self.num_calls += 1
        raise SessionStoreUnavailable("redis is down")

    async def close(self) -> None:
        pass


class _RecordingLimiter(InProcessRateLimiter):
    def __init__(self) -> None:
        super().__init__()
        self.keys: list[str] = []

    async def acquire(
        self, key: str, requests: int, tokens: int, limits: RateLimits
    ) -> RateDecision:
        self.keys.append(key)
        return await super().acquire(key, requests, tokens, limits)


def test_a_down_backend_admits_and_is_skipped_for_a_while() -> None:
    now = [0.0]
    backend = _DownLimiter()
    limiter = RequestRateLimiter(
        backend, RateLimits(requests_per_min=1), skip_after_failure_s=5, clock=lambda: now[0]
    )

    async def run() -> None:
        await limiter.admit("k", 10)  # fails open
        await limiter.admit("k", 10)  # not asked again within 5 s
        assert backend.num_calls == 1
        now[0] = 6.0
        await limiter.admit("k", 10)
        assert backend.num_calls == 2

    asyncio.run(run())


def test_without_keys_everyone_shares_the_anonymous_bucket() -> None:
    backend = _RecordingLimiter()
    limiter = RequestRateLimiter(backend, RateLimits(requests_per_min=1))

    async def run() -> None:
        await limiter.admit(None, 1)
        with pytest.raises(RateLimitError) as info:
            await limiter.admit(None, 1)
        assert info.value.headers["Retry-After"] == "60"

    asyncio.run(run())
    assert backend.keys == [ANONYMOUS_KEY, ANONYMOUS_KEY]
