"""Sessions over REST on both backends (an SQLite file and a real redis-server): later turns
see earlier ones, the session routes, ownership by API key, and concurrent turns on one
session (exactly one stored per version; nothing lost or interleaved)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest

from duet.engine import AsyncEngine
from duet.session_store import RedisSessionStore, SessionStore, SqliteSessionStore
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, closing, make_app
from tests.session_store.conftest import RedisServer

OTHER_KEY = "sk-other-key"
GREEDY = {"temperature": 0, "max_tokens": 6}


def _store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> SessionStore:
    if kind == "sqlite":
        return SqliteSessionStore(tmp_path / "sessions.db")
    redis: RedisServer = request.getfixturevalue("redis_server")
    return RedisSessionStore.from_url(redis.url, key_prefix=f"test-{uuid.uuid4().hex[:12]}")


@pytest.fixture(params=["sqlite", "redis"])
def live(
    request: pytest.FixtureRequest, rest_engine: AsyncEngine, tmp_path: Path
) -> Iterator[LiveServer]:
    store = _store(request.param, tmp_path, request)
    app = make_app(
        rest_engine,
        MODEL_NAME,
        api_keys=[API_KEY, OTHER_KEY],
        session_store=store,
        lifespan=closing(store),
    )
    server = LiveServer(app).start()
    yield server
    server.stop()


def _client(live: LiveServer, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=60)


def _http(live: LiveServer, key: str = API_KEY) -> httpx2.Client:
    return httpx2.Client(base_url=live.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _create_session(live: LiveServer, key: str = API_KEY, **body: object) -> str:
    with _http(live, key) as http:
        r = http.post("/v1/sessions", json=body or None)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_three_turns_each_see_the_earlier_ones(live: LiveServer, rest_engine: AsyncEngine) -> None:
    session_id = _create_session(live)
    client = _client(live)
    expected: list[dict[str, str]] = []
    prompt_tokens = []
    for turn, question in enumerate(["hello there", "what did I say?", "and before that?"]):
        expected.append({"role": "user", "content": question})
        # What the model must have seen: every earlier turn, then this question.
        num_prompt = len(rest_engine.engine.encode_chat(expected))
        if turn == 1:  # one turn streamed: stored before the final chunk
            stream = client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": question}],
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"session_id": session_id, "ignore_eos": True},
                **GREEDY,
            )
            chunks = list(stream)
            reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-2].choices[0].finish_reason == "length"
            usage = chunks[-1].usage
        else:
            resp = client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": question}],
                extra_body={"session_id": session_id, "ignore_eos": True},
                **GREEDY,
            )
            reply, usage = resp.choices[0].message.content, resp.usage
        assert usage is not None and usage.prompt_tokens == num_prompt
        prompt_tokens.append(usage.prompt_tokens)
        expected.append({"role": "assistant", "content": reply})
    assert prompt_tokens[0] < prompt_tokens[1] < prompt_tokens[2]
    with _http(live) as http:
        stored = http.get(f"/v1/sessions/{session_id}").json()
    assert stored["version"] == 3 and stored["num_messages"] == 6
    assert stored["messages"] == expected


def test_session_routes_and_ownership(live: LiveServer) -> None:
    session_id = _create_session(live, metadata={"user": "ada"}, ttl_s=600)
    other_id = _create_session(live, OTHER_KEY)
    with _http(live) as http, _http(live, OTHER_KEY) as other:
        got = http.get(f"/v1/sessions/{session_id}").json()
        assert got["id"] == session_id and got["object"] == "session"
        assert (got["metadata"], got["version"], got["messages"]) == ({"user": "ada"}, 0, [])
        assert [s["id"] for s in http.get("/v1/sessions").json()["data"]] == [session_id]
        assert [s["id"] for s in other.get("/v1/sessions").json()["data"]] == [other_id]
        # Another key's session reads as unknown, for every route and for chat.
        for r in (
            other.get(f"/v1/sessions/{session_id}"),
            other.delete(f"/v1/sessions/{session_id}"),
            other.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "session_id": session_id},
            ),
        ):
            assert r.status_code == 404, r.text
            error = r.json()["error"]
            assert (error["param"], error["code"]) == ("session_id", "session_not_found")
        deleted = http.delete(f"/v1/sessions/{session_id}")
        assert deleted.json() == {"id": session_id, "object": "session.deleted", "deleted": True}
        assert http.get(f"/v1/sessions/{session_id}").status_code == 404
        assert http.delete(f"/v1/sessions/{session_id}").status_code == 404
        assert http.get("/v1/sessions").json()["data"] == []
        bad = http.post("/v1/sessions", json={"ttl_s": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttl_s"


def test_session_request_errors(live: LiveServer) -> None:
    session_id = _create_session(live)
    client = _client(live)
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(
            model=MODEL_NAME, messages=user, extra_body={"session_id": uuid.uuid4().hex}
        )
    assert unknown.value.body["param"] == "session_id"
    with pytest.raises(openai.BadRequestError) as n:
        client.chat.completions.create(
            model=MODEL_NAME, messages=user, n=2, extra_body={"session_id": session_id}
        )
    assert n.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(
            model=MODEL_NAME, prompt="hi", extra_body={"session_id": session_id}
        )
    assert completion.value.body["param"] == "session_id"
    with _http(live) as http:
        assert http.get(f"/v1/sessions/{session_id}").json()["version"] == 0  # nothing stored


def test_concurrent_turns_store_one_per_version(live: LiveServer) -> None:
    session_id = _create_session(live)

    async def turn(aclient: openai.AsyncOpenAI, i: int) -> tuple[int, str]:
        try:
            resp = await aclient.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": f"question {i}"}],
                temperature=0,
                max_tokens=24,
                extra_body={"session_id": session_id, "ignore_eos": True},
            )
        except openai.ConflictError as e:
            assert (e.code, e.body["param"]) == ("session_conflict", "session_id")
            return 409, ""
        return 200, resp.choices[0].message.content or ""

    async def race() -> list[tuple[int, str]]:
        async with openai.AsyncOpenAI(
            base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=60
        ) as aclient:
            return await asyncio.gather(*(turn(aclient, i) for i in range(6)))

    results = asyncio.run(race())
    codes = [code for code, _ in results]
    assert set(codes) <= {200, 409} and 409 in codes and 200 in codes
    stored_turns = {
        (f"question {i}", reply) for i, (code, reply) in enumerate(results) if code == 200
    }
    with _http(live) as http:
        stored = http.get(f"/v1/sessions/{session_id}").json()
    messages = stored["messages"]
    assert stored["version"] == len(stored_turns) and len(messages) == 2 * len(stored_turns)
    # Each stored turn is a (question, its own reply) pair, adjacent: none interleaved or lost.
    pairs = {
        (messages[j]["content"], messages[j + 1]["content"]) for j in range(0, len(messages), 2)
    }
    assert [m["role"] for m in messages] == ["user", "assistant"] * len(stored_turns)
    assert pairs == stored_turns
