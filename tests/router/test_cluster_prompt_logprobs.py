"""Prompt logprobs through disaggregated prefill and decode (in-process workers, gRPC on
loopback): the prefill worker computes them and its answer carries them to the router, which
sends no output of the request before they are in; the values equal the aggregated engine's."""

from __future__ import annotations

import asyncio

from engine import LLM, SamplingParams
from tests.router.test_cluster_engine import ENGINE, Cluster, prompts_of


def test_disaggregated_prompt_logprobs_equal_aggregated(tiny_llama: str) -> None:
    # 4 tokens: under the threshold, yet prefilled on the prefill worker (which computes them).
    prompts = prompts_of([30, 4])
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2, n=2)
    want = LLM(tiny_llama, **ENGINE).generate(prompts, params)

    async def main():
        async with Cluster(tiny_llama, threshold=8) as c:
            firsts = []

            async def run(prompt):
                first = None
                async for out in c.engine.generate(prompt, params):
                    first = first or out
                    last = out
                firsts.append(first)
                return last

            got = await asyncio.gather(*(run(p) for p in prompts))
            return got, firsts

    got, firsts = asyncio.run(main())
    for g, w in zip(got, want, strict=True):
        assert g.prompt_logprobs is not None and w.prompt_logprobs is not None
        assert g.prompt_logprobs[0] is None
        assert [
            None if d is None else [(t, lp.logprob, lp.rank) for t, lp in d.items()]
            for d in g.prompt_logprobs
        ] == [
            None if d is None else [(t, lp.logprob, lp.rank) for t, lp in d.items()]
            for d in w.prompt_logprobs
        ]
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
    assert all(f.prompt_logprobs is not None for f in firsts)  # in the very first output
