"""Quantized weights through disaggregated serving: prefill and decode workers load int4 (or
int8) weights from the same config and give the aggregated engine's greedy tokens and logprobs
bit for bit (bf16, deterministic mode)."""

from __future__ import annotations

import asyncio

import pytest

from duet.engine import LLM, SamplingParams
from tests.cluster.test_cluster_engine import ENGINE, Cluster, _logprobs, prompts_of


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_cluster_equals_aggregated_bitwise(tiny_llama: str, quantization: str) -> None:
    engine = {**ENGINE, "dtype": "bfloat16", "quantization": quantization}
    prompts = prompts_of([3, 40, 77, 9, 120, 33])
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    ref = LLM(tiny_llama, **engine)
    dense = LLM(tiny_llama, **{**ENGINE, "dtype": "bfloat16"})
    assert ref.engine.weight_bytes < dense.engine.weight_bytes
    want = [ref.generate([p], greedy)[0].outputs[0] for p in prompts]

    async def main():
        async with Cluster(tiny_llama, engine=engine) as c:
            assert c.engine.deterministic
            got = await asyncio.gather(*(c.run(p, greedy) for p in prompts))
            return [o.outputs[0] for o in got]

    got = asyncio.run(main())
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert _logprobs(g) == _logprobs(w)
