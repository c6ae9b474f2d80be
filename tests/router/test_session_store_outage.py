"""Redis killed mid-run (SIGKILL, AOF on): turns in flight fail instead of reporting success,
session requests get a fast 503 (gRPC UNAVAILABLE) while requests without a session keep
working, and after Redis restarts on the same port and directory every acknowledged turn is
there and new turns work, without restarting the servers."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import grpc
import httpx2
import pytest

from duet.engine import AsyncEngine
from duet.session_store import RedisSessionStore
from tests.net import free_port
from tests.router.live_grpc import LiveGrpcServer, chat_request, collect_text
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, closing, make_app
from tests.session_store.conftest import RedisServer
from tests.waiting import wait_for

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {API_KEY}"),)
FAST_S = 2.0  # well under the store's 2.5 s operation timeout: refused, not timed out


def _chat(content: str, session_id: str | None = None, **extra: object) -> dict[str, object]:
    body: dict[str, object] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 4,
        "ignore_eos": True,
        **extra,
    }
    if session_id is not None:
        body["session_id"] = session_id
    return body


def test_redis_killed_mid_run(rest_engine: AsyncEngine, tmp_path: Path) -> None:
    redis = RedisServer(tmp_path, free_port())
    redis.start()
    rest_store = RedisSessionStore.from_url(redis.url)
    grpc_store = RedisSessionStore.from_url(redis.url)  # a second replica's own client
    live = LiveServer(
        make_app(
            rest_engine,
            MODEL_NAME,
            api_keys=[API_KEY],
            session_store=rest_store,
            lifespan=closing(rest_store),
        )
    ).start()
    grpc_live = LiveGrpcServer(
        rest_engine, (grpc_store,), api_keys=[API_KEY], session_store=grpc_store
    )
    http = httpx2.Client(base_url=live.url, headers=AUTH, timeout=30)
    try:
        session_id = http.post("/v1/sessions").json()["id"]
        first = http.post("/v1/chat/completions", json=_chat("first", session_id))
        assert first.status_code == 200
        acknowledged = [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
        ]

        # 1. A streamed turn whose store dies mid-generation ends with an error event, and
        #    its final chunk (finish_reason) never arrives: it was not stored.
        body = _chat("streamed", session_id, max_tokens=300, stream=True)
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")  # the role chunk: generation started
            redis.kill()
            events = [line.removeprefix("data: ") for line in lines if line]
        assert "[DONE]" not in events  # an error ends the stream: the reply is not whole
        error = json.loads(events[-1])["error"]
        assert error["code"] == "session_store_unavailable"
        assert all('"finish_reason":"length"' not in e for e in events)

        # 2. While Redis is down: session requests fail fast; the rest keep working.
        for method, path, payload in (
            ("POST", "/v1/chat/completions", _chat("down", session_id)),
            ("GET", f"/v1/sessions/{session_id}", None),
            ("POST", "/v1/sessions", None),
        ):
            start = time.monotonic()
            r = http.request(method, path, json=payload)
            assert time.monotonic() - start < FAST_S
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "session_store_unavailable"
        assert http.post("/v1/chat/completions", json=_chat("no session")).status_code == 200
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(grpc_live.stub.Chat(chat_request("down", session_id), metadata=GRPC_AUTH))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < FAST_S
        _, usage = collect_text(grpc_live.stub.Chat(chat_request("hi"), metadata=GRPC_AUTH))
        assert usage is not None and usage.completion_tokens == 6

        # 3. Back on the same port and AOF: the acknowledged turn is there, nothing else.
        redis.start()
        stored = http.get(f"/v1/sessions/{session_id}").json()
        assert stored["messages"] == acknowledged and stored["version"] == 1

        # 4. A non-streamed turn whose store dies mid-generation is a 503, not a 200.
        result: dict[str, httpx2.Response] = {}
        worker = threading.Thread(
            target=lambda: result.update(
                r=http.post("/v1/chat/completions", json=_chat("lost", session_id, max_tokens=300))
            )
        )
        worker.start()
        # Its session was read: generation started.
        wait_for(rest_engine.engine.has_unfinished_requests, 10, "the request in the engine", 0.005)
        redis.kill()
        worker.join(30)
        assert result["r"].status_code == 503
        assert result["r"].json()["error"]["code"] == "session_store_unavailable"

        # 5. Restarted again: new turns work over both APIs, with no duet restart.
        redis.start()
        third = http.post("/v1/chat/completions", json=_chat("third", session_id))
        assert third.status_code == 200, third.text
        reply, _ = collect_text(
            grpc_live.stub.Chat(chat_request("fourth", session_id), metadata=GRPC_AUTH)
        )
        stored = http.get(f"/v1/sessions/{session_id}").json()
        assert stored["version"] == 3
        assert stored["messages"][:2] == acknowledged
        assert [m["content"] for m in stored["messages"][2:]] == [
            "third",
            third.json()["choices"][0]["message"]["content"],
            "fourth",
            reply,
        ]
    finally:
        http.close()
        grpc_live.stop()
        live.stop()
        redis.stop()
