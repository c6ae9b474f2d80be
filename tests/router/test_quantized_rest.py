"""Quantized weights behind the REST API, as a user serves them: the embedded SmolLM2 (a Q4_1
GGUF) with its GGUF tensors kept quantized (`--quantization gguf`) and requantized to int4
(`--quantization int4`), in bf16, driven by the official `openai` client. Greedy chats, one at a
time, streamed and all at once, give the offline engine's text for the same configuration."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest

from duet.engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from duet.engine.model.quantized_linear import QuantizedLinear
from tests.router.rest_server import LiveServer, make_app

pytestmark = pytest.mark.slow

TOPICS = ["the moon", "a lighthouse", "prime numbers", "a sleepy cat"]
MAX_TOKENS = 12
CONFIG = dict(dtype="bfloat16", load_progress=False, kv_cache_memory_bytes=128 << 20)


def _messages(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write one sentence about {topic}."}]


@pytest.fixture(scope="module", params=["gguf", "int4"])
def served(request) -> Iterator[tuple[str, LiveServer, list[str]]]:
    quantization = request.param
    offline = LLM(**CONFIG, quantization=quantization)
    layers = [m for m in offline.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * 30  # q|k|v, o, gate|up and down in each of 30 layers
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.chat([_messages(t) for t in TOPICS], greedy)]
    del offline
    engine = AsyncEngine.from_config(EngineConfig(**CONFIG, quantization=quantization))
    assert engine.engine.weight_bytes < 200 << 20  # bf16 holds 310.6 MiB
    live = LiveServer(make_app(engine, "smollm2")).start(timeout_s=120)
    yield quantization, live, expected
    live.stop()
    engine.shutdown()


def test_quantized_chats_over_rest_equal_the_offline_engine(served) -> None:
    quantization, server, expected = served

    def body(topic: str) -> dict:
        return dict(model="smollm2", messages=_messages(topic), max_tokens=MAX_TOKENS,
                    temperature=0, extra_body={"ignore_eos": True})  # fmt: skip

    async def main() -> tuple[list[str], list[str], list[str]]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300
        ) as client:

            async def one(topic: str) -> str:
                resp = await client.chat.completions.create(**body(topic))
                return resp.choices[0].message.content or ""

            async def streamed(topic: str) -> str:
                parts = []
                async for chunk in await client.chat.completions.create(**body(topic), stream=True):
                    if chunk.choices:
                        parts.append(chunk.choices[0].delta.content or "")
                return "".join(parts)

            alone = [await one(t) for t in TOPICS]
            streams = [await streamed(t) for t in TOPICS]
            together = await asyncio.gather(*(one(t) for t in TOPICS))
            return alone, streams, list(together)

    alone, streams, together = asyncio.run(main())
    assert all(expected), quantization
    assert alone == expected, quantization
    assert streams == expected, quantization
    assert together == expected, quantization
