"""Streaming lifecycle: exact SSE framing, a client that leaves frees its KV blocks, and many
concurrent streams produce the same tokens as one at a time."""

from __future__ import annotations

import asyncio
import json

import httpx2
import openai
import pytest

from duet.engine import AsyncEngine
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, wait_until_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"max_tokens": 900, "ignore_eos": True}  # far longer than any test waits for


def test_sse_framing(http: httpx2.Client) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""  # every event, the last included, ends with a blank line
    events = events[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"] == []
    assert payloads[-1]["usage"]["completion_tokens"] <= 5
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert all("usage" in p for p in payloads)


def test_completion_sse_framing(http: httpx2.Client) -> None:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
        raw = b"".join(r.iter_bytes()).decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(p["object"] == "text_completion" and "usage" not in p for p in payloads)


def test_stream_disconnect_frees_blocks(client: openai.OpenAI, rest_engine: AsyncEngine) -> None:
    assert wait_until_idle(rest_engine)
    generated_before = rest_engine.engine.stats.num_generated_tokens
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "tell me a long story"}],
        stream=True,
        n=2,
        extra_body=LONG,
    )
    num_chunks = 0
    for _ in stream:
        num_chunks += 1
        if num_chunks == 4:
            break
    stream.close()
    assert wait_until_idle(rest_engine), "the aborted request still holds KV blocks"
    # It was aborted, not run to the end.
    assert rest_engine.engine.stats.num_generated_tokens - generated_before < 2 * 900


def test_non_stream_disconnect_frees_blocks(
    rest_server: LiveServer, rest_engine: AsyncEngine
) -> None:
    assert wait_until_idle(rest_engine)
    generated_before = rest_engine.engine.stats.num_generated_tokens
    body = {"model": MODEL_NAME, "prompt": "tell me a long story", "n": 16, **LONG}
    with pytest.raises(httpx2.ReadTimeout):  # the client gives up and closes the connection
        httpx2.post(f"{rest_server.url}/v1/completions", json=body, headers=AUTH, timeout=0.3)
    assert wait_until_idle(rest_engine), "the abandoned request still holds KV blocks"
    assert rest_engine.engine.stats.num_generated_tokens - generated_before < 16 * 900


def test_64_concurrent_streams_match_sequential(
    rest_server: LiveServer, client: openai.OpenAI
) -> None:
    prompts = [f"Request {i}: paged attention stores" for i in range(16)]
    kwargs = dict(
        model=MODEL_NAME, temperature=0, max_tokens=8, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    sequential = {}
    for p in prompts:
        resp = client.completions.create(prompt=p, **kwargs)
        sequential[p] = resp.choices[0].logprobs.tokens

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, list[str], str]:
        tokens: list[str] = []
        finish = ""
        stream = await aclient.completions.create(prompt=prompt, stream=True, **kwargs)
        async for chunk in stream:
            for c in chunk.choices:
                tokens += c.logprobs.tokens if c.logprobs else []
                finish = c.finish_reason or finish
        return prompt, tokens, finish

    async def run() -> list[tuple[str, list[str], str]]:
        async with openai.AsyncOpenAI(
            base_url=f"{rest_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60
        ) as aclient:
            return await asyncio.gather(*(one(aclient, prompts[i % 16]) for i in range(64)))

    results = asyncio.run(run())
    assert len(results) == 64
    for prompt, tokens, finish in results:
        assert finish == "length"
        assert tokens == sequential[prompt]
