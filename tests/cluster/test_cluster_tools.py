"""Tool-call and reasoning grammars through disaggregated prefill and decode: a `required`
tool choice's grammar survives a decode worker lost mid-call (the replacement replays the
streamed tokens into it), and a grammar that starts after the thinking travels to the workers
like any other."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import jsonschema

from duet.engine import LLM, SamplingParams
from duet.router.openai_tools import ChatTool, plan_tools
from tests.cluster.test_cluster_engine import ENGINE, Cluster, prompts_of

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [ChatTool.model_validate({"function": {"name": "get_weather", "parameters": WEATHER}})]


def _calls(text: str) -> list[dict]:
    calls = json.loads(text)
    for call in calls:
        assert call["name"] == "get_weather"
        jsonschema.validate(call["parameters"], WEATHER)
    return calls


def test_a_tool_call_survives_a_lost_decode_worker_and_thinking_travels(tiny_llama: str) -> None:
    prompts = prompts_of([40, 70], seed=5)
    required = plan_tools(TOOLS, "required", False).constraint()
    params = SamplingParams(max_tokens=120, temperature=0, structured_outputs=required)
    assert required is not None
    thinking = SamplingParams(
        max_tokens=30, temperature=0,
        structured_outputs=dataclasses.replace(required, reasoning="thinking"),
    )  # fmt: skip
    ref = LLM(tiny_llama, **ENGINE)
    want = ref.generate(prompts, params)
    want_thinking = ref.generate(prompts, thinking)
    assert all(len(w.token_ids) > 10 for w in want)

    async def main():
        async with Cluster(tiny_llama, num_decode=2, threshold=0) as c:
            outs, victim = await c.stream_losing_a_decode_worker(prompts, params)
            after = await asyncio.gather(*(c.run(p, thinking) for p in prompts))
            return outs, victim, after

    outs, victim, after = asyncio.run(main())
    assert victim is not None
    for got, w in zip(outs, want, strict=True):
        assert got[-1].token_ids == w.token_ids
        assert got[-1].outputs[0].finish_reason == "stop"
        assert len(_calls(got[-1].text)) == 1
    assert [o.token_ids for o in after] == [w.token_ids for w in want_thinking]
