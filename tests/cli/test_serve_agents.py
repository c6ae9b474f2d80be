"""The OpenAI Agents SDK's default `Agent` (the Responses API) against `duet serve`: a
function-tool round trip. The tiny random model calls the tool because the first turn's
`tool_choice` is required (a grammar; one call, as `parallel_tool_calls` is off); the SDK then resets it to auto and sends the whole
conversation back as items, and the model's reply, held to the agent's output type by its JSON
schema (`text.format`: the grammar ends it, so it completes), is the final output. Run again
with `conversation_id` (the Conversations API): the same final output, and the conversation
holds the run's four items."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Literal

import httpx2
from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI
from pydantic import BaseModel

from tests.net import free_port
from tests.waiting import wait_for


def _ready(url: str, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, f"duet serve exited with {proc.returncode}"
    try:
        return httpx2.get(f"{url}/ready", timeout=1).status_code == 200
    except httpx2.TransportError:
        return False


def test_agents_sdk_default_agent_completes_a_function_tool_round_trip(
    tiny_llama: str, tmp_path: Path
) -> None:
    port = free_port()
    cmd = [
        sys.executable, "-m", "duet.cli", "serve", "--model", tiny_llama, "--dtype", "float32",
        "--port", str(port), "--grpc-port", "0", "--served-model-name", "tiny", "--no-ui",
        "--api-key", "sk-agents", "--session-store", f"sqlite:///{tmp_path / 'duet.db'}",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ready(url, proc), 120, "duet serve to be ready", 0.1)
        cities: list[str] = []

        class Forecast(BaseModel):
            sky: Literal["sunny", "rainy"]

        @function_tool
        def get_weather(city: Literal["Paris", "Rome"]) -> str:
            """The weather in a city."""
            cities.append(city)
            return "sunny"

        async def run() -> tuple[object, object, list[str]]:
            client = AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-agents", max_retries=0)
            set_default_openai_client(client, use_for_tracing=False)
            set_tracing_disabled(True)
            agent = Agent(
                name="weather", instructions="Answer with the weather tool.", model="tiny",
                tools=[get_weather], output_type=Forecast,
                model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                             max_tokens=120, temperature=0),
            )  # fmt: skip
            try:
                plain = await Runner.run(agent, "Weather in Paris?", max_turns=3)
                # The same run with its history in a server-side conversation: the SDK sends
                # only each turn's new items, the server reads and extends the conversation.
                conv = await client.conversations.create()
                kept = await Runner.run(
                    agent, "Weather in Paris?", max_turns=3, conversation_id=conv.id
                )
                items = [
                    i.type async for i in client.conversations.items.list(conv.id, order="asc")
                ]
                return plain, kept, items
            finally:
                await client.close()

        result, kept, items = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for run_result in (result, kept):
        kinds = [type(item) for item in run_result.new_items]  # type: ignore[attr-defined]
        assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem], kinds
        assert len(run_result.raw_responses) == 2  # type: ignore[attr-defined]
        assert isinstance(run_result.final_output, Forecast)  # type: ignore[attr-defined]
    assert len(cities) == 2
    assert kept.final_output == result.final_output  # type: ignore[attr-defined]
    assert items == ["message", "function_call", "function_call_output", "message"]
