"""AsyncEngine: streaming deltas add up to the offline result; leaving early aborts."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest

from duet.engine import (
    LLM,
    AsyncEngine,
    EngineConfig,
    InvalidInputError,
    SamplingParams,
    StructuredOutputsParams,
)
from duet.engine.structured_output import GrammarCompiler
from tests.waiting import wait_for_async


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = AsyncEngine.from_config(
        EngineConfig(model=tiny_llama, dtype="float32", load_progress=False)
    )
    yield eng
    eng.shutdown()


def test_stream_matches_offline(engine, tiny_llama):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = ["Paged attention stores keys", "The quick brown fox", "def add(a, b):"]
    offline = LLM(tiny_llama, dtype="float32", load_progress=False).generate(prompts, params)

    async def run(prompt: str):
        text, ids, last = "", [], None
        async for out in engine.generate(prompt, params):
            text += out.outputs[0].delta_text
            ids += out.outputs[0].delta_token_ids
            last = out
        return text, ids, last

    async def main():
        return await asyncio.gather(*(run(p) for p in prompts))

    for (text, ids, last), ref in zip(asyncio.run(main()), offline, strict=True):
        assert ids == ref.token_ids
        assert text == ref.text == last.text
        assert last.finished and last.finish_reason == "length"


def test_leaving_early_aborts_and_frees(engine):
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        n = 0
        async for _ in engine.generate("The quick brown fox", params, request_id="leaver"):
            n += 1
            if n == 3:
                break
        # The abort is applied by the engine thread; wait (bounded) until the pool is whole.
        await wait_for_async(
            lambda: not engine.engine.has_unfinished_requests(), 5, "the abort to apply"
        )

    asyncio.run(main())
    assert not engine.engine.has_unfinished_requests()
    assert engine.engine.kv.num_free_blocks == engine.engine.num_blocks


def test_bad_input_raises_before_queueing(engine):
    async def main():
        async for _ in engine.generate("", SamplingParams()):
            pass

    with pytest.raises(InvalidInputError) as info:
        asyncio.run(main())
    assert info.value.field == "prompt"


def test_requests_after_shutdown_fail_fast(tiny_llama):
    from duet.engine.async_engine import EngineDeadError

    eng = AsyncEngine.from_config(
        EngineConfig(model=tiny_llama, dtype="float32", load_progress=False)
    )
    eng.shutdown()
    assert not eng.is_running

    async def main():
        async for _ in eng.generate("hello", SamplingParams(max_tokens=4)):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(main(), timeout=10))


def test_new_grammars_compile_off_the_engine_thread(engine, monkeypatch):
    compiler = engine.engine.grammar_compiler
    compiled_on: list[str] = []
    real = GrammarCompiler.compile

    def spy(self, params):
        before = self.num_compiled
        out = real(self, params)
        if self.num_compiled > before:
            compiled_on.append(threading.current_thread().name)
        return out

    monkeypatch.setattr(GrammarCompiler, "compile", spy)
    spec = StructuredOutputsParams(regex="(red|green) [0-9]{2}")
    params = SamplingParams(max_tokens=20, temperature=0, structured_outputs=spec)

    async def main():
        last = None
        async for out in engine.generate("color:", params):
            last = out
        return last

    last = asyncio.run(main())
    assert last.finish_reason == "stop"
    assert re.fullmatch("(red|green) [0-9]{2}", last.text)
    assert len(compiled_on) == 1 and not compiled_on[0].startswith("duet-")
    assert compiler.num_cache_hits >= 1  # the engine thread found it compiled
