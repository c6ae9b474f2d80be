"""Tools in background chat requests: the result's tool calls, the events stream's tool-call
deltas (from the start or from any offset) and the stored session turn name the same calls
with the same ids; the arguments validate (the `required` grammar applies)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import jsonschema
import openai

from duet.engine import AsyncEngine
from tests.router.rest_server import API_KEY, MODEL_NAME
from tests.router.test_background import AUTH, serve, wait_completed
from tests.router.test_tool_calling import MESSAGES, SCHEMAS, TOOLS


def _chunks(url: str, request_id: str, offset: int) -> list[dict[str, Any]]:
    """Each event's choice (delta and finish_reason) from `offset` until [DONE]."""
    out = []
    with httpx2.stream("GET", f"{url}/v1/chat/completions/{request_id}/events",
                       params={"offset": offset}, headers=AUTH, timeout=60) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return out
            if line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                assert "error" not in chunk, chunk
                out.append(chunk["choices"][0])
    raise AssertionError("the stream ended without [DONE]")


def test_background_tool_calls_agree_everywhere(rest_engine: AsyncEngine, tmp_path: Path) -> None:
    live = serve(rest_engine, tmp_path / "duet.db")
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)
        session_id = httpx2.post(f"{live.url}/v1/sessions", headers=AUTH).json()["id"]
        queued = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
            temperature=1.0, seed=5, max_tokens=200,
            extra_body={"background": True, "session_id": session_id},
        )  # fmt: skip
        done = wait_completed(client, queued.id)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert calls and len({i for i, _, _ in calls}) == len(calls)
        for _, name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        # The events stream: tool-call deltas that add up to the same calls, same ids.
        chunks = _chunks(live.url, queued.id, 0)
        streamed: list[list[str]] = []
        for c in chunks:
            assert not c["delta"].get("content")
            for d in c["delta"].get("tool_calls") or []:
                if d.get("id"):
                    streamed.append([d["id"], d["function"]["name"], ""])
                streamed[d["index"]][2] += d["function"].get("arguments") or ""
        assert [tuple(s) for s in streamed] == calls
        assert chunks[-1]["finish_reason"] == "tool_calls"
        # A client reconnecting at any offset gets the rest, the same as the first reader.
        for offset in (1, len(chunks) // 2, len(chunks) - 1):
            assert _chunks(live.url, queued.id, offset) == chunks[offset:], offset
        stored = httpx2.get(f"{live.url}/v1/sessions/{session_id}", headers=AUTH).json()
        assert stored["messages"][-1] == {
            "role": "assistant", "content": "",
            "tool_calls": [{"id": i, "type": "function",
                            "function": {"name": n, "arguments": json.loads(a)}}
                           for i, n, a in calls],
        }  # fmt: skip
    finally:
        live.stop()


def test_background_reply_splits_thinking_with_a_reasoning_parser(
    rest_engine: AsyncEngine, tmp_path: Path, monkeypatch
) -> None:
    """Without tools too, a server with `--reasoning-parser` puts a background reply's thinking
    in `reasoning_content`, in the result and in the events stream, as it does for the same
    request in the foreground (before, the background reply kept it all in `content`)."""
    from duet.router.openai_chat import ChatOptions
    from tests.router.test_reasoning import QWEN3_TEMPLATE

    tokenizer = rest_engine.engine.tokenizer
    monkeypatch.setattr(tokenizer, "chat_template", QWEN3_TEMPLATE)  # it opens <think>
    monkeypatch.setattr(tokenizer, "_template", None)
    live = serve(
        rest_engine, tmp_path / "duet.db", chat_options=ChatOptions(reasoning_parser="qwen3")
    )
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)
        kwargs: dict[str, Any] = dict(model=MODEL_NAME, messages=MESSAGES, temperature=0,
                                      max_tokens=12)  # fmt: skip
        foreground = client.chat.completions.create(**kwargs).choices[0].message
        assert foreground.reasoning_content and foreground.content is None
        queued = client.chat.completions.create(**kwargs, extra_body={"background": True})
        message = wait_completed(client, queued.id).choices[0].message
        assert (message.reasoning_content, message.content) == (foreground.reasoning_content, None)
        deltas = [c["delta"] for c in _chunks(live.url, queued.id, 0)]
        assert (
            "".join(d.get("reasoning_content") or "" for d in deltas) == message.reasoning_content
        )
        assert not any(d.get("content") for d in deltas)
    finally:
        live.stop()
