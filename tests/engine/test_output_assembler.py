"""Text and stop strings leave the engine thread (issue 17): the engine hands token ids to
each stream's reader, whose `OutputAssembler` detokenizes and matches stop strings, and a stop
it finds ends the sample in the engine (`FinishStopped`), dropping the tokens made meanwhile."""

from __future__ import annotations

import asyncio
import threading

import pytest

from duet.engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from duet.engine.llm_engine import LLMEngine
from duet.engine.output_processor import OutputAssembler
from duet.engine.outputs import EngineOutput, SampleDelta
from duet.engine.tokenizer import Tokenizer
from tests.waiting import wait_for_async

PROMPT = "The quick brown fox"


def config(model: str) -> EngineConfig:
    return EngineConfig(model=model, dtype="float32", load_progress=False)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = AsyncEngine.from_config(config(tiny_llama))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy offline text of PROMPT (40 tokens), and a stop string from its middle."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    out = LLM(tiny_llama, dtype="float32", load_progress=False).generate([PROMPT], params)[0]
    text = out.text
    assert len(text) > 30, text
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    assert text.find(stop) == len(text) // 2, "pick a stop string found only once"
    return out, stop


def stream(engine: AsyncEngine, params: SamplingParams):
    async def main():
        text, last = "", None
        async for out in engine.generate(PROMPT, params):
            text += out.outputs[0].delta_text
            last = out
        return text, last

    return asyncio.run(main())


def test_text_and_stop_strings_are_made_off_the_engine_thread(
    engine, reference, tiny_llama, monkeypatch
):
    _, stop = reference
    threads: set[str] = set()
    for name in ("decode", "id_to_token"):
        real = getattr(Tokenizer, name)

        def spy(self, *args, _real=real, **kwargs):
            threads.add(threading.current_thread().name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Tokenizer, name, spy)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, stop=[stop], logprobs=2)
    before = engine.engine.stats.num_generated_tokens
    text, last = stream(engine, params)

    offline = LLM(tiny_llama, dtype="float32", load_progress=False).generate([PROMPT], params)[0]
    assert last.finished and last.finish_reason == "stop" and last.outputs[0].stop_reason == stop
    assert text == last.text == offline.text and stop not in text
    assert last.token_ids == offline.token_ids
    assert [lp.sampled.token_id for lp in last.logprobs] == last.token_ids
    assert threading.main_thread().name in threads
    assert not [t for t in threads if t.startswith("duet-")], threads  # never the engine's

    async def settled():
        await wait_for_async(
            lambda: not engine.engine.has_unfinished_requests(), 5, "the stop to reach the engine"
        )

    asyncio.run(settled())
    # The engine kept exactly the tokens up to the stop: any it made meanwhile were dropped.
    assert engine.engine.stats.num_generated_tokens - before == len(last.token_ids)
    assert engine.engine.kv.num_free_blocks == engine.engine.num_blocks


def test_a_late_stop_drops_the_tokens_made_after_it(tiny_llama, reference):
    ref, stop = reference
    eng = LLMEngine(config(tiny_llama))
    eng.assemble_outputs = False  # as under an EngineCore: the caller assembles
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, stop=[stop])
    eng.add_request(PROMPT, params, "r")
    _, ids = eng.tokenize_prompt(PROMPT)
    assembler = eng.new_assembler("r", PROMPT, ids, params)
    stops: list[tuple[int, int]] = []
    outputs = []
    while not stops:
        for raw in eng.step_outputs():
            assert isinstance(raw, EngineOutput) and not hasattr(raw, "text")
            outputs.append(assembler.add(raw))
            stops += assembler.take_stops()
    for _ in range(3):  # the engine runs on before the stop reaches it
        for raw in eng.step_outputs():
            outputs.append(assembler.add(raw))  # tokens after a stop change nothing
            assert assembler.take_stops() == []
    ((index, kept),) = stops
    request = eng.requests.states["r"].samples[0].request
    assert index == 0 and request.num_output_tokens == kept + 3
    generated = eng.stats.num_generated_tokens
    eng.finish_stopped("r", index, kept)
    assert request.output_token_ids == outputs[-1].token_ids
    assert len(outputs[-1].token_ids) == kept
    assert eng.stats.num_generated_tokens == generated - 3
    assert not eng.has_unfinished_requests() and "r" not in eng.requests
    assert eng.kv.num_free_blocks == eng.num_blocks
    assert outputs[-1].finished and outputs[-1].text == ref.text[: ref.text.find(stop)]
    eng.finish_stopped("r", index, kept)  # late or repeated: a no-op
    assert eng.step_outputs() == []


def test_one_sample_stopping_leaves_the_others_running(tiny_llama):
    tokenizer = LLMEngine(config(tiny_llama)).tokenizer
    word = next(t for t in range(200, 400) if tokenizer.decode([t]).strip().isalpha())
    stop = tokenizer.decode([word])
    params = SamplingParams(n=2, max_tokens=4, stop=[stop])
    assembler = OutputAssembler(tokenizer, "r", None, [1, 2, 3], params)
    other = next(t for t in range(400, 600) if stop not in tokenizer.decode([t]))
    out = assembler.add(
        EngineOutput("r", [SampleDelta(0, [other, word, other]), SampleDelta(1, [other])])
    )
    assert assembler.take_stops() == [(0, 2)]  # sample 0 keeps the token that completed it
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == [other, word]
    assert out.outputs[1].finish_reason is None and not out.finished
    deltas = [SampleDelta(0, [other]), SampleDelta(1, [other], finish_reason="length")]
    out = assembler.add(EngineOutput("r", deltas, finished=True))
    assert out.outputs[0].token_ids == [other, word] and out.outputs[0].delta_token_ids == []
    assert out.outputs[1].finish_reason == "length" and out.outputs[1].token_ids == [other] * 2
    assert out.finished and assembler.take_stops() == []
