"""The SessionStore contract, run unchanged against every backend (SQLite and a real Redis)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from duet.session_store import (
    SessionConflict,
    SessionNotFound,
    SessionStore,
    hash_api_key,
)

pytestmark = pytest.mark.timeout(60)


def turn(i: int) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": f"question {i}", "turn": i},
        {"role": "assistant", "content": f"answer {i} ✓", "turn": i},
    ]


def test_create_get_append_history(store_factory, run):
    async def body(store: SessionStore) -> None:
        created = await store.create("sk-alice", metadata={"model": "smollm2", "n": 1})
        assert len(created.id) == 32
        assert created.version == 0 and created.num_messages == 0
        assert created.api_key_hash == hash_api_key("sk-alice") != "sk-alice"
        assert created.metadata == {"model": "smollm2", "n": 1}
        assert created.is_owned_by("sk-alice") and not created.is_owned_by("sk-bob")
        assert await store.get(created.id) == created
        assert await store.history(created.id) == []

        assert await store.append_turn(created.id, turn(0)) == 1
        assert await store.append_turn(created.id, [{"role": "user", "content": "more"}]) == 2
        assert await store.history(created.id) == [*turn(0), {"role": "user", "content": "more"}]

        got = await store.get(created.id)
        assert (got.version, got.num_messages) == (2, 3)
        assert got.created_at == created.created_at <= got.updated_at
        assert got.metadata == created.metadata

    run(store_factory, body)


def test_missing_session(store_factory, run):
    async def body(store: SessionStore) -> None:
        missing = "0" * 32
        with pytest.raises(SessionNotFound):
            await store.get(missing)
        with pytest.raises(SessionNotFound):
            await store.history(missing)
        with pytest.raises(SessionNotFound):
            await store.append_turn(missing, turn(0))
        assert await store.delete(missing) is False

    run(store_factory, body)


def test_delete(store_factory, run):
    async def body(store: SessionStore) -> None:
        keep = await store.create("sk-alice")
        gone = await store.create("sk-alice")
        await store.append_turn(gone.id, turn(0))
        assert await store.delete(gone.id) is True
        with pytest.raises(SessionNotFound):
            await store.get(gone.id)
        with pytest.raises(SessionNotFound):
            await store.history(gone.id)
        with pytest.raises(SessionNotFound):
            await store.append_turn(gone.id, turn(1))
        assert await store.delete(gone.id) is False
        assert [s.id for s in await store.list("sk-alice")] == [keep.id]

    run(store_factory, body)


def test_list_by_api_key(store_factory, run):
    async def body(store: SessionStore) -> None:
        a1 = await store.create("sk-alice")
        b1 = await store.create("sk-bob")
        a2 = await store.create("sk-alice", metadata={"k": "v"})
        anon = await store.create(None)
        await store.append_turn(a1.id, turn(0))

        alice = await store.list("sk-alice")
        assert [s.id for s in alice] == [a1.id, a2.id]
        assert [(s.version, s.num_messages) for s in alice] == [(1, 2), (0, 0)]
        assert alice[1].metadata == {"k": "v"}
        assert [s.id for s in await store.list("sk-bob")] == [b1.id]
        assert [s.id for s in await store.list(None)] == [anon.id]
        assert anon.api_key_hash is None
        assert await store.list("sk-nobody") == []

    run(store_factory, body)


def test_ttl_expires_and_each_append_refreshes_it(store_factory, run):
    async def body(store: SessionStore) -> None:
        # NOTE: the margins against a slow, loaded machine are 0.5 s where a late wake-up
        # would fail the test, 0.2-0.3 s where it cannot.
        session = await store.create("sk-ttl", ttl_s=1.2)
        forever = await store.create("sk-ttl", ttl_s=3600)
        await asyncio.sleep(0.7)
        await store.append_turn(session.id, turn(0))  # expiry now 1.2 s from here
        await asyncio.sleep(0.7)  # past the creation-time expiry, inside the refreshed one
        assert (await store.get(session.id)).version == 1
        assert await store.history(session.id) == turn(0)
        await asyncio.sleep(0.8)
        with pytest.raises(SessionNotFound):
            await store.get(session.id)
        with pytest.raises(SessionNotFound):
            await store.history(session.id)
        with pytest.raises(SessionNotFound):
            await store.append_turn(session.id, turn(1))
        assert [s.id for s in await store.list("sk-ttl")] == [forever.id]
        assert await store.delete(session.id) is False

    run(store_factory, body)


def test_version_conflict(store_factory, run):
    async def body(store: SessionStore) -> None:
        session = await store.create("sk-alice")
        assert await store.append_turn(session.id, turn(0), expected_version=0) == 1
        with pytest.raises(SessionConflict) as info:
            await store.append_turn(session.id, turn(1), expected_version=0)
        assert (info.value.expected_version, info.value.actual_version) == (0, 1)
        assert await store.history(session.id) == turn(0)
        assert (await store.get(session.id)).version == 1
        assert await store.append_turn(session.id, turn(1), expected_version=1) == 2

    run(store_factory, body)


def test_concurrent_turns_lose_nothing_and_never_interleave(store_factory, run):
    async def body(store: SessionStore) -> None:
        session = await store.create("sk-alice")
        versions = await asyncio.gather(
            *(store.append_turn(session.id, turn(i)) for i in range(20))
        )
        assert sorted(versions) == list(range(1, 21))

        history = await store.history(session.id)
        assert len(history) == 40
        pairs = [history[i : i + 2] for i in range(0, 40, 2)]
        for user, assistant in pairs:
            assert (user["role"], assistant["role"]) == ("user", "assistant")
            assert user["turn"] == assistant["turn"]
        assert sorted(user["turn"] for user, _ in pairs) == list(range(20))
        # The version a turn got is its position in the history.
        position = {user["turn"]: n + 1 for n, (user, _) in enumerate(pairs)}
        assert [position[i] for i in range(20)] == versions
        assert (await store.get(session.id)).num_messages == 40

    run(store_factory, body)


def test_optimistic_concurrency_one_winner_then_all_land_with_retries(store_factory, run):
    async def body(store: SessionStore) -> None:
        session = await store.create("sk-alice")
        results = await asyncio.gather(
            *(store.append_turn(session.id, turn(i), expected_version=0) for i in range(10)),
            return_exceptions=True,
        )
        assert sum(r == 1 for r in results) == 1
        assert sum(isinstance(r, SessionConflict) for r in results) == 9

        async def append_with_retry(i: int) -> int:
            while True:
                version = (await store.get(session.id)).version
                try:
                    return await store.append_turn(session.id, turn(i), expected_version=version)
                except SessionConflict:
                    await asyncio.sleep(0)

        versions = await asyncio.gather(*(append_with_retry(i) for i in range(10, 30)))
        assert sorted(versions) == list(range(2, 22))
        history = await store.history(session.id)
        assert len(history) == 42
        winners = [m["turn"] for m in history[::2]]
        assert winners[0] < 10 and sorted(winners[1:]) == list(range(10, 30))

    run(store_factory, body)


def test_rejects_bad_input(store_factory, run):
    async def body(store: SessionStore) -> None:
        session = await store.create("sk-alice")
        with pytest.raises(ValueError, match="non-empty list"):
            await store.append_turn(session.id, [])
        with pytest.raises(ValueError, match=r"messages\[1\] must be a dict"):
            await store.append_turn(session.id, [{"role": "user"}, "hi"])  # type: ignore[list-item]
        with pytest.raises(ValueError, match=r"messages\[0\] must be JSON-serializable"):
            await store.append_turn(session.id, [{"role": "user", "content": object()}])
        with pytest.raises(ValueError, match="expected_version"):
            await store.append_turn(session.id, turn(0), expected_version="0")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="ttl_s"):
            await store.create("sk-alice", ttl_s=0)
        with pytest.raises(ValueError, match="metadata"):
            await store.create("sk-alice", metadata={"x": {1, 2}})
        assert await store.history(session.id) == []
        assert (await store.get(session.id)).version == 0

    run(store_factory, body)


def test_stored_responses_put_get_conditional_replace_delete(store_factory, run):
    """A stored response by id with its owner; `only_from` writes only over a stored status in
    it (a cancelled background response is never overwritten as completed)."""

    async def body(store: SessionStore) -> None:
        doc = {"response": {"id": "resp_1", "status": "queued"}, "messages": [{"role": "user"}]}
        assert await store.get_response("resp_1") is None
        owner = hash_api_key("sk-a")
        assert await store.put_response("resp_1", owner, "done", doc, only_from={"queued"}) is False
        assert await store.get_response("resp_1") is None  # nothing stored: nothing replaced
        assert await store.put_response("resp_1", owner, "queued", doc) is True
        stored = await store.get_response("resp_1")
        assert stored is not None
        assert (stored.id, stored.status, stored.doc) == ("resp_1", "queued", doc)
        assert stored.api_key_hash == hash_api_key("sk-a") and stored.is_owned_by("sk-a")
        assert not stored.is_owned_by("sk-b") and not stored.is_owned_by(None)
        assert await store.put_response("resp_1", owner, "cancelled", doc, {"queued"}) is True
        assert await store.put_response("resp_1", owner, "completed", doc, {"queued"}) is False
        stored = await store.get_response("resp_1")
        assert stored is not None and stored.status == "cancelled"
        await store.put_response("resp_2", None, "completed", {"n": 2})
        anonymous = await store.get_response("resp_2")
        assert anonymous is not None and anonymous.is_owned_by(None)
        assert await store.delete_response("resp_1") is True
        assert await store.delete_response("resp_1") is False
        assert await store.get_response("resp_1") is None
        assert await store.get_response("resp_2") is not None

    run(store_factory, body)
