"""Speculative decoding on a decode worker: the prompt's KV comes from a prefill worker, the
decode worker speculates (ngram), and the tokens are those of an aggregated engine without
speculation."""

from __future__ import annotations

import asyncio

from duet.engine import LLM, SamplingParams
from tests.decode_worker.test_remote_decode import (
    ENGINE,
    assert_pools_whole,
    disaggregated,
    start_workers,
)

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": 64}  # fmt: skip
PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 10, list(range(20, 60)), [42] * 20,
           [(i * 37) % 500 + 3 for i in range(70)]]  # fmt: skip


def test_disaggregated_ngram_equals_aggregated_without(tiny_llama):
    prefill, decode = start_workers(tiny_llama, "tcp", speculative_config=SPEC)
    try:
        greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        seeded = SamplingParams(max_tokens=24, temperature=0.2, seed=7, ignore_eos=True)
        ref = LLM(tiny_llama, **ENGINE)
        want = ref.generate(PROMPTS, greedy) + ref.generate(PROMPTS, seeded)

        async def run():
            return await asyncio.gather(
                *(disaggregated(prefill, decode, f"g{i}", p, greedy) for i, p in enumerate(PROMPTS)),
                *(disaggregated(prefill, decode, f"s{i}", p, seeded) for i, p in enumerate(PROMPTS)),
            )  # fmt: skip

        results = asyncio.run(run())
        got = [outs[-1] for _, outs in results]
        assert [o.token_ids for o in got] == [w.outputs[0].token_ids for w in want]
        for _, outs in results:  # every token streamed exactly once
            deltas = [t for out in outs for t in out.outputs[0].delta_token_ids]
            assert deltas == outs[-1].token_ids
        stats = decode.engine.stats.spec_decode
        assert stats is not None and stats.num_accepted_tokens > 0
        assert_pools_whole(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()
