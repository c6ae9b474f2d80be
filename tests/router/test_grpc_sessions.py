"""Sessions through gRPC `Chat`: a REST replica and a gRPC server on one SQLite file continue the
same conversation; unknown or foreign sessions are NOT_FOUND, n > 1 is INVALID_ARGUMENT, and
concurrent turns on one session store one per version (the others ABORTED)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx2
import pytest

from duet.engine import AsyncEngine
from duet.session_store import SqliteSessionStore
from tests.router.live_grpc import LiveGrpcServer, chat_request, collect_text
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, closing, make_app

OTHER_KEY = "sk-other-key"
KEYS = [API_KEY, OTHER_KEY]
AUTH = (("authorization", f"Bearer {API_KEY}"),)


@pytest.fixture(scope="module")
def servers(
    rest_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveServer, LiveGrpcServer]]:
    path = tmp_path_factory.mktemp("grpc-sessions") / "sessions.db"
    rest_store, grpc_store = SqliteSessionStore(path), SqliteSessionStore(path)
    app = make_app(
        rest_engine,
        MODEL_NAME,
        api_keys=KEYS,
        session_store=rest_store,
        lifespan=closing(rest_store),
    )
    rest = LiveServer(app).start()
    grpc_live = LiveGrpcServer(rest_engine, (grpc_store,), api_keys=KEYS, session_store=grpc_store)
    yield rest, grpc_live
    grpc_live.stop()
    rest.stop()


@pytest.fixture
def http(servers: tuple[LiveServer, LiveGrpcServer]) -> Iterator[httpx2.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx2.Client(base_url=servers[0].url, headers=headers, timeout=30) as client:
        yield client


def test_three_turns_over_grpc_see_the_earlier_ones(
    servers: tuple[LiveServer, LiveGrpcServer], http: httpx2.Client, rest_engine: AsyncEngine
) -> None:
    stub = servers[1].stub
    session_id = http.post("/v1/sessions").json()["id"]
    expected: list[dict[str, str]] = []
    for question in ("one", "two", "three"):
        expected.append({"role": "user", "content": question})
        num_prompt = len(rest_engine.engine.encode_chat(expected))
        reply, usage = collect_text(
            stub.Chat(chat_request(question, session_id), metadata=AUTH, timeout=30)
        )
        assert usage is not None and usage.prompt_tokens == num_prompt
        expected.append({"role": "assistant", "content": reply})
    stored = http.get(f"/v1/sessions/{session_id}").json()
    assert stored["version"] == 3 and stored["messages"] == expected


def test_grpc_session_errors(
    servers: tuple[LiveServer, LiveGrpcServer], http: httpx2.Client
) -> None:
    stub = servers[1].stub
    session_id = http.post("/v1/sessions").json()["id"]
    other = (("authorization", f"Bearer {OTHER_KEY}"),)
    for request, metadata, code, field in (
        (chat_request("hi", "f" * 32), AUTH, grpc.StatusCode.NOT_FOUND, "session_id"),
        (chat_request("hi", session_id), other, grpc.StatusCode.NOT_FOUND, "session_id"),
        (chat_request("hi", session_id, n=2), AUTH, grpc.StatusCode.INVALID_ARGUMENT, "n"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Chat(request, metadata=metadata, timeout=30))
        assert info.value.code() == code
        assert info.value.details().startswith(f"{field}:")
    assert http.get(f"/v1/sessions/{session_id}").json()["version"] == 0


def test_concurrent_grpc_turns_store_one_per_version(
    servers: tuple[LiveServer, LiveGrpcServer], http: httpx2.Client
) -> None:
    stub = servers[1].stub
    session_id = http.post("/v1/sessions").json()["id"]

    def turn(i: int) -> tuple[grpc.StatusCode, str]:
        request = chat_request(f"question {i}", session_id, max_tokens=24)
        try:
            reply, _ = collect_text(stub.Chat(request, metadata=AUTH, timeout=30))
        except grpc.RpcError as e:
            return e.code(), ""
        return grpc.StatusCode.OK, reply

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(turn, range(4)))
    codes = [code for code, _ in results]
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.ABORTED}
    assert grpc.StatusCode.ABORTED in codes
    stored_turns = {
        (f"question {i}", reply)
        for i, (code, reply) in enumerate(results)
        if code == grpc.StatusCode.OK
    }
    messages = http.get(f"/v1/sessions/{session_id}").json()["messages"]
    pairs = {
        (messages[j]["content"], messages[j + 1]["content"]) for j in range(0, len(messages), 2)
    }
    assert len(messages) == 2 * len(stored_turns) and pairs == stored_turns


def test_a_grpc_tool_call_is_stored_with_its_id(
    servers: tuple[LiveServer, LiveGrpcServer], http: httpx2.Client
) -> None:
    import json

    from duet.v1 import serving_pb2

    schema = {"type": "object", "properties": {"days": {"enum": [1, 2]}}, "required": ["days"],
              "additionalProperties": False}  # fmt: skip
    tool = serving_pb2.Tool(name="get_weather", parameters_json=json.dumps(schema))
    session_id = http.post("/v1/sessions").json()["id"]
    req = serving_pb2.ChatRequest(
        messages=[serving_pb2.ChatMessage(role="user", content="weather?")],
        sampling=serving_pb2.SamplingOptions(max_tokens=60, temperature=0),
        tools=[tool], tool_choice_function="get_weather", session_id=session_id,
    )  # fmt: skip
    deltas = [d for r in servers[1].stub.Chat(req, metadata=AUTH, timeout=60) for d in r.tool_calls]
    call_id, arguments = deltas[0].id, "".join(d.arguments for d in deltas)
    stored = http.get(f"/v1/sessions/{session_id}").json()["messages"]
    assert stored[-1] == {
        "role": "assistant", "content": "",
        "tool_calls": [{"id": call_id, "type": "function",
                        "function": {"name": "get_weather", "arguments": json.loads(arguments)}}],
    }  # fmt: skip
