"""Structured outputs through disaggregated prefill and decode (in-process workers, gRPC on
loopback): the prefill worker's first token is already constrained, the decode worker goes on
under the same grammar, and a decode worker lost mid-output is replaced by one that replays
the streamed tokens into the grammar first, so the JSON still parses and equals the unfailed
run's."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema

from duet.engine import LLM, SamplingParams, StructuredOutputsParams
from tests.cluster.test_cluster_engine import ENGINE, Cluster, prompts_of

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 3,
                 "maxItems": 5},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tags", "ok"],
    "additionalProperties": False,
}  # fmt: skip
REGEX = r"[a-z]{4,8}@[0-9]{2}\.(com|org)"


def test_disaggregated_structured_outputs_equal_aggregated(tiny_llama: str) -> None:
    prompts = prompts_of([30, 50, 4])
    json_greedy = SamplingParams(
        max_tokens=200, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    regex_seeded = SamplingParams(
        max_tokens=60, temperature=1.0, seed=9, structured_outputs=StructuredOutputsParams(regex=REGEX)
    )  # fmt: skip
    ref = LLM(tiny_llama, **ENGINE)
    want = [ref.generate(prompts, p) for p in (json_greedy, regex_seeded)]

    async def main():
        # threshold 8: the 4-token prompt is prefilled on the decode worker (local generate).
        async with Cluster(tiny_llama, threshold=8) as c:
            return [
                await asyncio.gather(*(c.run(p, params) for p in prompts))
                for params in (json_greedy, regex_seeded)
            ]

    got = asyncio.run(main())
    for got_kind, want_kind in zip(got, want, strict=True):
        assert [o.token_ids for o in got_kind] == [o.token_ids for o in want_kind]
        assert all(o.outputs[0].finish_reason == "stop" for o in got_kind)
    for out in got[0]:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert all(re.fullmatch(REGEX, out.text) for out in got[1])


def test_decode_worker_lost_mid_json_continues_under_the_grammar(tiny_llama: str) -> None:
    prompts = prompts_of([40, 70], seed=4)
    params = SamplingParams(
        max_tokens=200, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    want = LLM(tiny_llama, **ENGINE).generate(prompts, params)
    assert all(len(w.token_ids) > 10 for w in want)

    async def main():
        async with Cluster(tiny_llama, num_decode=2, threshold=0) as c:
            return await c.stream_losing_a_decode_worker(prompts, params)

    outs, victim = asyncio.run(main())
    assert victim is not None
    for got, w in zip(outs, want, strict=True):
        assert got[-1].token_ids == w.token_ids
        assert got[-1].outputs[0].finish_reason == "stop"
        streamed = [t for o in got for t in o.outputs[0].delta_token_ids]
        assert streamed == w.token_ids  # nothing repeated, nothing missing
        jsonschema.validate(json.loads(got[-1].text), SCHEMA)
