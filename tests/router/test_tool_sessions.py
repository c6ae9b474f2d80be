"""Tools with `session_id` (REST and gRPC): the stored assistant turn holds the tool calls
under the ids the client got (in the chat templates' shape), so the next turn's `tool`
message answers a call the history has, and the prompt is the whole conversation rendered."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from duet.engine import AsyncEngine
from duet.session_store import SqliteSessionStore
from tests.router.rest_server import (
    API_KEY,
    MODEL_NAME,
    TRUSTED_TEMPLATES,
    LiveServer,
    closing,
    make_app,
)
from tests.router.test_tool_calling import HERMES_TEMPLATE, MESSAGES, TOOLS, _streamed_calls

REQUIRED: dict[str, Any] = dict(
    model=MODEL_NAME, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
    temperature=0, max_tokens=200, extra_body={"chat_template": HERMES_TEMPLATE},
)  # fmt: skip


@pytest.fixture
def live(rest_engine: AsyncEngine, tmp_path: Path) -> Iterator[LiveServer]:
    store = SqliteSessionStore(tmp_path / "sessions.db")
    app = make_app(rest_engine, MODEL_NAME, api_keys=[API_KEY], session_store=store,
                   chat_options=TRUSTED_TEMPLATES, lifespan=closing(store))  # fmt: skip
    server = LiveServer(app).start()
    yield server
    server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip_on_a_session(
    live: LiveServer, rest_engine: AsyncEngine, stream: bool
) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx2.Client(base_url=live.url, headers=headers, timeout=60) as http:
        session_id = http.post("/v1/sessions").json()["id"]
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)
        extra = {**REQUIRED["extra_body"], "session_id": session_id}
        kwargs = {**REQUIRED, "extra_body": extra, "messages": MESSAGES}
        if stream:
            _, calls, finish = _streamed_calls(
                list(client.chat.completions.create(**kwargs, stream=True))
            )
        else:
            resp = client.chat.completions.create(**kwargs)
            finish = resp.choices[0].finish_reason
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in resp.choices[0].message.tool_calls or []]  # fmt: skip
        assert finish == "tool_calls" and len(calls) == 1
        [call] = calls
        stored = http.get(f"/v1/sessions/{session_id}").json()["messages"]
        assistant = {
            "role": "assistant", "content": "",
            "tool_calls": [{"id": call["id"], "type": "function", "function": {
                "name": call["name"], "arguments": json.loads(call["arguments"])}}],
        }  # fmt: skip
        assert stored == [*MESSAGES, assistant]
        # Turn 2: the tool's result answers the stored call; the prompt is all of it rendered.
        result = {"role": "tool", "tool_call_id": call["id"], "content": "rain"}
        second = client.chat.completions.create(
            model=MODEL_NAME, messages=[result], tools=TOOLS, tool_choice="none", max_tokens=3,
            extra_body={"chat_template": HERMES_TEMPLATE, "session_id": session_id},
        )  # fmt: skip
        whole = [*MESSAGES, assistant, result]
        r = http.post("/tokenize", json={"model": MODEL_NAME, "messages": whole, "tools": TOOLS,
                                         "chat_template": HERMES_TEMPLATE})  # fmt: skip
        assert r.status_code == 200, r.text
        assert second.usage is not None and second.usage.prompt_tokens == r.json()["count"]
        assert f"<tool_response>{call['id']}: rain" in rest_engine.tokenizer.decode(
            r.json()["tokens"], skip_special_tokens=False
        )
