"""Servers with their own engines: a full admission queue answers 503 with Retry-After, and a
dead engine ends in-flight streams with an error event (never a hang) and fails probes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx2
import openai
import pytest

from duet.engine import AsyncEngine
from tests.router.rest_server import MODEL_NAME, LiveServer, make_app, make_engine, wait_until_idle

MESSAGES = [{"role": "user", "content": "tell me a long story"}]
LONG = {"max_tokens": 900, "ignore_eos": True}  # far longer than any test waits for


@pytest.fixture
def small(tiny_llama: str) -> Iterator[tuple[LiveServer, AsyncEngine]]:
    """One running sequence and one queued: a third concurrent sequence is refused."""
    engine = make_engine(tiny_llama, max_num_seqs=1)
    live = LiveServer(make_app(engine, MODEL_NAME, max_queued_requests=1)).start()
    yield live, engine
    live.stop()
    engine.shutdown()


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=20)


def test_full_queue_is_503_with_retry_after(small: tuple[LiveServer, AsyncEngine]) -> None:
    live, engine = small
    client = _client(live)
    streams = []
    for _ in range(2):
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, stream=True, extra_body=LONG
        )
        next(iter(stream))  # the role chunk: this request is admitted
        streams.append(stream)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    err = info.value
    assert err.status_code == 503
    assert err.code == "overloaded"
    assert err.response.headers["retry-after"] == "1"
    with pytest.raises(openai.InternalServerError):  # streaming requests are refused up front
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, stream=True)
    for stream in streams:
        stream.close()
    assert wait_until_idle(engine)
    # The capacity came back.
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    assert resp.choices[0].finish_reason in ("length", "stop")


async def _status_codes(live: LiveServer, count: int, timeout_s: float, **body) -> list[int]:
    """`count` concurrent completions (`body`): each one's HTTP status."""

    async def one(aclient: openai.AsyncOpenAI) -> int:
        try:
            await aclient.completions.create(model=MODEL_NAME, **body)
        except openai.APIStatusError as e:
            return e.status_code
        return 200

    async with openai.AsyncOpenAI(
        base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=timeout_s
    ) as aclient:
        return await asyncio.gather(*(one(aclient) for _ in range(count)))


def test_flood_gets_some_503s_and_the_rest_complete(
    small: tuple[LiveServer, AsyncEngine],
) -> None:
    live, engine = small

    codes = asyncio.run(
        _status_codes(live, 12, 20, prompt="flood", max_tokens=200, extra_body={"ignore_eos": True})
    )
    assert set(codes) <= {200, 503}
    assert codes.count(200) >= 2
    assert codes.count(503) >= 1
    assert wait_until_idle(engine)


def test_default_admission_queues_a_load_tools_burst(tiny_llama: str) -> None:
    """300 concurrent requests on a 2-sequence engine: the default queue (bounded by the
    measured drain rate, not a count) takes them all, as vLLM does; a fixed bound of 256
    refused dozens."""
    engine = make_engine(tiny_llama, max_num_seqs=2)
    live = LiveServer(make_app(engine, MODEL_NAME)).start()

    try:
        codes = asyncio.run(_status_codes(live, 300, 120, prompt="burst", max_tokens=1))
        assert codes == [200] * 300
        assert wait_until_idle(engine)
    finally:
        live.stop()
        engine.shutdown()


def test_engine_death_ends_streams_with_an_error_event(tiny_llama: str) -> None:
    engine = make_engine(tiny_llama)
    live = LiveServer(make_app(engine, MODEL_NAME)).start()
    try:
        client = _client(live)
        body = {"model": MODEL_NAME, "prompt": "a long story", "stream": True, **LONG}
        with httpx2.stream("POST", f"{live.url}/v1/completions", json=body, timeout=20) as raw:
            lines = raw.iter_lines()
            assert next(lines).startswith("data: {")
            stream = iter(
                client.chat.completions.create(
                    model=MODEL_NAME, messages=MESSAGES, stream=True, extra_body=LONG
                )
            )
            next(stream)
            engine.shutdown()
            with pytest.raises(openai.APIError) as info:
                for _ in stream:
                    pass
            assert info.value.code == "engine_unavailable"
            assert "engine stopped" in info.value.message
            events = [line for line in lines if line]
        # The error event ends the stream: no [DONE], which would say the reply is whole.
        assert "data: [DONE]" not in events
        error = json.loads(events[-1].removeprefix("data: "))["error"]
        assert error["type"] == "service_unavailable"
        assert error["code"] == "engine_unavailable"
        # New requests and the probes say the engine is gone, and when to retry.
        with pytest.raises(openai.InternalServerError) as info_new:
            client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        assert info_new.value.status_code == 503
        assert info_new.value.response.headers["retry-after"] == "1"
        assert httpx2.get(f"{live.url}/health").status_code == 503
        assert httpx2.get(f"{live.url}/ready").status_code == 503
    finally:
        live.stop()
        engine.shutdown()
