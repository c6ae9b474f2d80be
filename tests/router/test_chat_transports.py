"""One chat turn, rendered by every transport: the same chat through REST, gRPC, the Batch API
and a background request is one `ChatTurn` each, yielding the same events (tool calls
included), rendered to the same reply, and storing the same session turn."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx2
import openai
import pytest
from fastapi import FastAPI

from duet.engine import AsyncEngine, EngineConfig
from duet.router.api_server import build_app
from duet.router.chat_events import ChatStep, Final, ToolCallDelta
from duet.router.chat_turn import ChatTurn
from duet.router.front_door import FrontDoor, RouterOptions
from duet.router.grpc_server import start_grpc_server
from duet.session_store import SqliteSessionStore, SqliteWorkQueue
from duet.v1 import serving_pb2, serving_pb2_grpc
from tests.router.rest_server import API_KEY, MODEL_NAME, NUM_KV_BLOCKS, LiveServer
from tests.router.test_background import wait_completed
from tests.router.test_batches import create_batch, read_jsonl, wait_done
from tests.router.test_tool_calling import TOOLS

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {API_KEY}"),)
CONTENT = "What is the weather in Paris?"
PLAIN: dict[str, Any] = {"max_tokens": 24, "ignore_eos": True}
REQUIRED: dict[str, Any] = {
    "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200,
}  # fmt: skip


class Served:
    """REST and gRPC over one front door (as `duet serve` runs them), a session store and a
    work queue; every chat turn's steps recorded in order."""

    def __init__(self, engine: AsyncEngine, db: Path) -> None:
        self.store, self.queue = SqliteSessionStore(db), SqliteWorkQueue(db)
        options = RouterOptions(api_keys=[API_KEY], session_store=self.store, work_queue=self.queue)
        self.front = FrontDoor.compose(engine, MODEL_NAME, options)
        self.grpc_port = 0
        self.live = LiveServer(build_app(self.front, self._lifespan)).start()
        self.turns: list[list[ChatStep]] = []

    @asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        server, self.grpc_port = await start_grpc_server(self.front, port=0)
        try:
            yield
        finally:
            await server.stop(1)
            await self.store.close()
            await self.queue.close()

    def record(self, monkeypatch: pytest.MonkeyPatch) -> None:
        steps_of = ChatTurn.steps

        async def recorded(turn: ChatTurn, *args: Any) -> AsyncIterator[ChatStep]:
            steps: list[ChatStep] = []
            self.turns.append(steps)
            async with aclosing(steps_of(turn, *args)) as it:
                async for step in it:
                    steps.append(step)
                    yield step

        monkeypatch.setattr(ChatTurn, "steps", recorded)

    def session(self) -> str:
        return str(
            httpx2.post(f"{self.live.url}/v1/sessions", headers=AUTH, timeout=10).json()["id"]
        )

    def stored(self, session_id: str) -> list[dict[str, Any]]:
        url = f"{self.live.url}/v1/sessions/{session_id}"
        return list(httpx2.get(url, headers=AUTH, timeout=10).json()["messages"])


@pytest.fixture(scope="module")
def engine(tiny_llama: str) -> Iterator[AsyncEngine]:
    # No prefix cache: each transport's turn reports the same usage (no cached tokens).
    config = EngineConfig(model=tiny_llama, dtype="float32", load_progress=False,
                          num_kv_blocks=NUM_KV_BLOCKS, enable_prefix_caching=False)  # fmt: skip
    engine = AsyncEngine.from_config(config)
    yield engine
    engine.shutdown()


@pytest.fixture
def served(
    engine: AsyncEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Served]:
    s = Served(engine, tmp_path / "duet.db")
    s.record(monkeypatch)
    yield s
    s.live.stop()


def body(tools: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": CONTENT}],
            "temperature": 0, **tools, **extra}  # fmt: skip


def rest(served: Served, tools: dict[str, Any], session_id: str) -> dict[str, Any]:
    url = f"{served.live.url}/v1/chat/completions"
    reply = httpx2.post(url, json=body(tools, session_id=session_id), headers=AUTH, timeout=60)
    assert reply.status_code == 200, reply.text
    return dict(reply.json()["choices"][0]["message"])


def grpc_chat(served: Served, tools: dict[str, Any], session_id: str) -> dict[str, Any]:
    request = serving_pb2.ChatRequest(
        messages=[serving_pb2.ChatMessage(role="user", content=CONTENT)],
        sampling=serving_pb2.SamplingOptions(
            max_tokens=tools["max_tokens"], temperature=0, ignore_eos=tools.get("ignore_eos", False)
        ),
        session_id=session_id,
    )
    if "tools" in tools:
        for tool in tools["tools"]:
            fn = tool["function"]
            request.tools.append(serving_pb2.Tool(
                name=fn["name"], description=fn["description"],
                parameters_json=json.dumps(fn["parameters"])))  # fmt: skip
        request.tool_choice = tools["tool_choice"]
        request.parallel_tool_calls = tools["parallel_tool_calls"]
    content, calls = "", {}
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        for r in serving_pb2_grpc.DuetStub(channel).Chat(request, metadata=GRPC_AUTH, timeout=60):
            content += r.text
            for d in r.tool_calls:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.name
                call["arguments"] += d.arguments
    return {"content": content or None, "tool_calls": list(calls.values())}


def batch(served: Served, tools: dict[str, Any]) -> dict[str, Any]:
    client = openai.OpenAI(base_url=f"{served.live.url}/v1", api_key=API_KEY, max_retries=0)
    line = {"custom_id": "one", "method": "POST", "url": "/v1/chat/completions",
            "body": body(tools)}  # fmt: skip
    done = wait_done(client, create_batch(client, json.dumps(line).encode()).id)
    [entry] = read_jsonl(client, done.output_file_id)
    return dict(entry["response"]["body"]["choices"][0]["message"])


def background(served: Served, tools: dict[str, Any], session_id: str) -> dict[str, Any]:
    url = f"{served.live.url}/v1/chat/completions"
    queued = httpx2.post(url, json=body(tools, session_id=session_id, background=True),
                         headers=AUTH, timeout=60)  # fmt: skip
    assert queued.status_code == 200, queued.text
    client = openai.OpenAI(base_url=f"{served.live.url}/v1", api_key=API_KEY, max_retries=0)
    done = wait_completed(client, queued.json()["id"])
    return dict(done.choices[0].message.model_dump())


def _calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, arguments) of each tool call (ids differ: interactive ones are random)."""
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        out.append((fn["name"], fn["arguments"]))
    return out


def _events(steps: list[ChatStep]) -> list[Any]:
    """A turn's events, tool-call ids blanked (interactive ones are random, background ones
    derive from the request id)."""
    out: list[Any] = []
    for step in steps:
        for event in step.events:
            if isinstance(event, ToolCallDelta) and event.call.id is not None:
                event = ToolCallDelta(event.index, event.call.model_copy(update={"id": "id"}))
            if isinstance(event, Final):
                replies = [
                    r.__class__(**{**r.__dict__, "tool_calls": [
                        c.model_copy(update={"id": "id"}) for c in r.tool_calls]})
                    for r in event.replies
                ]  # fmt: skip
                event = Final(replies, event.usage, event.prompt_logprobs)
            out.append(event)
    return out


@pytest.mark.parametrize("tools", [PLAIN, REQUIRED], ids=["plain", "tool-call"])
def test_one_chat_through_every_transport(served: Served, tools: dict[str, Any]) -> None:
    sessions = [served.session() for _ in range(3)]
    replies = {
        "rest": rest(served, tools, sessions[0]),
        "grpc": grpc_chat(served, tools, sessions[1]),
        "batch": batch(served, tools),
        "background": background(served, tools, sessions[2]),
    }
    # Each transport ran one turn (the background one on the queue's consumer), in order.
    assert len(served.turns) == 4
    first = _events(served.turns[0])
    assert all(_events(steps) == first for steps in served.turns[1:])
    final = first[-1]
    assert isinstance(final, Final)
    if "tools" in tools:
        assert [type(e).__name__ for e in first].count("ToolCallDelta") >= 2
        assert final.replies[0].finish_reason == "tool_calls"
    else:
        assert final.usage.completion_tokens == 24
    # Rendered alike: the same content and tool calls from each.
    contents = {name: m.get("content") for name, m in replies.items()}
    assert len(set(contents.values())) == 1, contents
    calls = {name: _calls(m) for name, m in replies.items()}
    assert all(c == calls["rest"] for c in calls.values()), calls
    assert bool(calls["rest"]) == ("tools" in tools)
    # The same session turn stored by each (the batch line has none: sessions are refused).
    stored = [served.stored(s) for s in sessions]
    for messages in stored:
        for message in messages:
            for call in message.get("tool_calls") or []:
                call["id"] = "id"
    assert stored[0] == stored[1] == stored[2]
    assert [m["role"] for m in stored[0]] == ["user", "assistant"]
    assert stored[0][0]["content"] == CONTENT
