"""The Redis backend against a real redis-server: key layout, restarts, hangs, shared buckets."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest
import redis

from duet.session_store import (
    RateLimits,
    RedisRateLimiter,
    RedisSessionStore,
    SessionStoreUnavailable,
    hash_api_key,
)

pytestmark = pytest.mark.timeout(60)


def turn(i: int) -> list[dict]:
    return [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]


def test_key_layout_hashes_api_keys_and_sets_ttls(redis_server):
    prefix = f"layout-{uuid.uuid4().hex[:8]}"
    secret = "sk-very-secret-key-123"

    async def body() -> str:
        async with RedisSessionStore.from_url(redis_server.url, key_prefix=prefix) as store:
            session = await store.create(secret, ttl_s=100)
            await store.append_turn(session.id, turn(0))
            return session.id

    session_id = asyncio.run(body())
    owner = hash_api_key(secret)
    client = redis.Redis(port=redis_server.port, decode_responses=True)
    try:
        meta, messages, index = (
            f"{prefix}:session:{session_id}",
            f"{prefix}:session:{session_id}:messages",
            f"{prefix}:sessions:by_key:{owner}",
        )
        assert set(client.keys(f"{prefix}:*")) == {meta, messages, index}
        assert [client.type(k) for k in (meta, messages, index)] == ["hash", "list", "zset"]
        fields = client.hgetall(meta)
        assert fields["api_key_hash"] == owner
        assert (fields["version"], fields["num_messages"], fields["ttl_ms"]) == ("1", "2", "100000")
        for key in (meta, messages, index):
            assert 99_000 < client.pttl(key) <= 100_000
        dump = repr([fields, client.lrange(messages, 0, -1), client.zrange(index, 0, -1)])
        assert secret not in dump
    finally:
        client.close()


def test_a_retried_append_whose_reply_was_lost_lands_once(redis_server):
    async def body() -> None:
        async with RedisSessionStore.from_url(redis_server.url, key_prefix="dedupe") as store:
            session = await store.create("sk-a")
            keys = [f"dedupe:session:{session.id}", f"dedupe:session:{session.id}:messages"]
            args = ["", "turn-1", "dedupe:sessions:by_key:", session.id, '{"role":"user"}']
            # What redis-py's retry sends after a lost reply: the same script, same turn id.
            assert await store._append(keys=keys, args=args) == [1, 1]
            assert await store._append(keys=keys, args=args) == [1, 1]
            assert await store.history(session.id) == [{"role": "user"}]

    asyncio.run(body())


def test_survives_a_redis_restart_with_the_same_store(make_redis_server):
    server = make_redis_server()

    async def body() -> None:
        store = RedisSessionStore.from_url(server.url)
        limiter = RedisRateLimiter.from_url(server.url)
        try:
            session = await store.create("sk-alice", metadata={"title": "restart"})
            for i in range(10):
                assert await store.append_turn(session.id, turn(i)) == i + 1

            server.kill()
            for op in (
                store.get(session.id),
                store.append_turn(session.id, turn(99)),
                store.history(session.id),
                limiter.acquire("sk-alice", 1, 1, RateLimits(requests_per_min=10)),
            ):
                started = time.monotonic()
                with pytest.raises(SessionStoreUnavailable):
                    await op
                assert time.monotonic() - started < 3.0

            server.start()  # same port, same AOF directory
            assert await store.history(session.id) == [m for i in range(10) for m in turn(i)]
            got = await store.get(session.id)
            assert (got.version, got.num_messages, got.metadata) == (10, 20, {"title": "restart"})
            assert await store.append_turn(session.id, turn(10), expected_version=10) == 11
            assert [s.id for s in await store.list("sk-alice")] == [session.id]
            assert (
                await limiter.acquire("sk-alice", 1, 1, RateLimits(requests_per_min=10))
            ).allowed
        finally:
            await store.close()
            await limiter.close()

    asyncio.run(body())


def test_a_hung_redis_times_out_instead_of_hanging(make_redis_server):
    server = make_redis_server()
    assert server.proc is not None
    pid = server.proc.pid

    async def body() -> None:
        async with RedisSessionStore.from_url(server.url, op_timeout_s=1.0) as store:
            session = await store.create("sk-a")
            os.kill(pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(SessionStoreUnavailable, match="timed out"):
                    await store.append_turn(session.id, turn(0))
                assert time.monotonic() - started < 2.0
            finally:
                os.kill(pid, signal.SIGCONT)
            # The timed-out append may or may not have landed; the store works again.
            version = (await store.get(session.id)).version
            assert await store.append_turn(session.id, turn(1)) == version + 1

    asyncio.run(body())


def test_replicas_share_one_set_of_buckets(redis_server):
    prefix = f"shared-{uuid.uuid4().hex[:8]}"
    limits = RateLimits(requests_per_min=4)

    async def body() -> None:
        a = RedisRateLimiter.from_url(redis_server.url, key_prefix=prefix)
        b = RedisRateLimiter.from_url(redis_server.url, key_prefix=prefix)
        try:
            decisions = [await (a, b)[i % 2].acquire("sk-a", 1, 0, limits) for i in range(5)]
            assert [d.allowed for d in decisions] == [True, True, True, True, False]
            assert 13.0 < decisions[-1].retry_after_s <= 15.0
        finally:
            await a.close()
            await b.close()

    asyncio.run(body())
    client = redis.Redis(port=redis_server.port, decode_responses=True)
    try:
        assert client.keys(f"{prefix}:*") == [f"{prefix}:ratelimit:{hash_api_key('sk-a')}"]
    finally:
        client.close()
