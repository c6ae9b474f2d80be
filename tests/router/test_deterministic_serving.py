"""Deterministic serving (issue 19), as a user meets it: the embedded SmolLM2-135M-Instruct in
bf16 behind the REST API, driven by the official `openai` client. Each of 16 chats sent alone,
again (half of them: the second hits the prefix cache) or streamed (the other half), and all 16
at once: every copy of a chat gets the same text and the same logprobs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest

from duet.engine import AsyncEngine, EngineConfig
from tests.router.rest_server import LiveServer, make_app

pytestmark = pytest.mark.slow

TOPICS = [
    "the moon", "a lighthouse", "paged attention", "Paris in spring", "a cup of tea", "rain",
    "prime numbers", "the ocean", "a red bicycle", "autumn leaves", "a robot", "jazz",
    "mountains", "a library", "the color blue", "a sleepy cat",
]  # fmt: skip
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engine = AsyncEngine.from_config(
        EngineConfig(dtype="bfloat16", load_progress=False, kv_cache_memory_bytes=256 << 20)
    )
    live = LiveServer(make_app(engine, "smollm2")).start(timeout_s=120)
    yield live
    live.stop()
    engine.shutdown()


def _body(topic: str) -> dict:
    return dict(
        model="smollm2",
        messages=[{"role": "user", "content": f"Write one sentence about {topic}."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )


def _reply(choice) -> tuple[str, list]:
    lps = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
           for t in choice.logprobs.content]  # fmt: skip
    return choice.message.content, lps


async def _one(client: openai.AsyncOpenAI, topic: str) -> tuple[str, list]:
    resp = await client.chat.completions.create(**_body(topic))
    return _reply(resp.choices[0])


async def _streamed(client: openai.AsyncOpenAI, topic: str) -> tuple[str, list]:
    text, lps = [], []
    async for chunk in await client.chat.completions.create(**_body(topic), stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0]
        text.append(delta.delta.content or "")
        if delta.logprobs is not None:
            lps += [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                    for t in delta.logprobs.content]  # fmt: skip
    return "".join(text), lps


def test_every_copy_of_a_chat_is_identical_in_bf16(server: LiveServer) -> None:
    async def main() -> tuple[list, list, list, list]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300
        ) as client:
            first = [await _one(client, t) for t in TOPICS]  # one at a time, cold
            second = [await _one(client, t) for t in TOPICS[::2]]  # prefix-cache hits
            streamed = [await _streamed(client, t) for t in TOPICS[1::2]]
            together = await asyncio.gather(*(_one(client, t) for t in TOPICS))  # batched
            return first, second, streamed, list(together)

    first, second, streamed, together = asyncio.run(main())
    assert all(text for text, _ in first)
    assert second == first[::2]
    assert streamed == first[1::2]
    assert together == first
