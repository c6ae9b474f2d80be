"""Request fields through disaggregated prefill and decode (in-process workers, gRPC on
loopback). Prompt logprobs: the prefill worker computes them and its answer carries them to the
router, which sends no output of the request before they are in; the values equal the
aggregated engine's. Priority: reaches the prefill and decode workers' schedulers.
`allowed_token_ids`: the prefill worker's first token and the decode worker's others keep to
them, as the aggregated engine's do. `cache_salt`: the prefill worker's prefix cache serves a
prompt only to requests of its salt."""

from __future__ import annotations

import asyncio

import pytest

from duet.engine import LLM, SamplingParams
from duet.engine.llm_engine import LLMEngine
from tests.cluster.test_cluster_engine import ENGINE, Cluster, prompts_of


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


def test_priority_reaches_the_prefill_and_decode_schedulers(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, int]] = []
    add_request, add_remote = LLMEngine.add_request, LLMEngine.add_remote_request

    def recording_add(self, prompt, params=None, request_id=None, priority=0, prefill_only=False,
                      **kw):  # fmt: skip
        seen.append(("prefill" if prefill_only else "local", priority))
        return add_request(self, prompt, params, request_id, priority, prefill_only, **kw)

    def recording_remote(self, ids, params, request_id, num_replayed=0, priority=0):
        seen.append(("remote", priority))
        return add_remote(self, ids, params, request_id, num_replayed, priority)

    monkeypatch.setattr(LLMEngine, "add_request", recording_add)
    monkeypatch.setattr(LLMEngine, "add_remote_request", recording_remote)
    params = SamplingParams(max_tokens=2, temperature=0)

    async def main():
        engine = dict(ENGINE, scheduling_policy="priority")
        async with Cluster(tiny_llama, threshold=8, engine=engine) as c:
            assert c.engine.scheduling_policy == "priority"
            for prompt, priority in zip(prompts_of([30, 4]), (7, -3), strict=True):
                async for _ in c.engine.generate(prompt, params, priority=priority):
                    pass

    asyncio.run(main())
    # 30 tokens: prefilled on the prefill worker, decoded on the decode worker; 4: all local.
    assert sorted(seen) == sorted([("prefill", 7), ("remote", 7), ("local", -3)])


@pytest.mark.parametrize("field", ["allowed_token_ids", "bad_words"])
def test_disaggregated_allowed_and_bad_words_equal_aggregated(tiny_llama: str, field: str) -> None:
    prompts = prompts_of([30, 12])
    reference = LLM(tiny_llama, **ENGINE)
    allowed = [20, 21, 22, 400]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    free = reference.generate(prompts, greedy)
    # bad words: each prompt's first two free tokens as a word (its first token banned after)
    words = [reference.engine.tokenizer.decode(f.token_ids[:2]) for f in free]
    change = (
        {"allowed_token_ids": allowed} if field == "allowed_token_ids" else {"bad_words": words}
    )
    params = [SamplingParams(max_tokens=8, temperature=t, seed=9, ignore_eos=True, **change)
              for t in (0, 1.0)]  # fmt: skip
    want = reference.generate(prompts, params)

    async def main():
        async with Cluster(tiny_llama, threshold=8) as c:

            async def run(prompt, p):
                async for out in c.engine.generate(prompt, p):
                    last = out
                return last

            return await asyncio.gather(*(run(*a) for a in zip(prompts, params, strict=True)))

    got = asyncio.run(main())
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    if field == "allowed_token_ids":
        assert all(set(w.token_ids) <= set(allowed) for w in want)
    else:
        assert want[0].token_ids != free[0].token_ids  # the greedy one had to turn off


def test_disaggregated_prefix_hits_only_within_a_cache_salt(tiny_llama: str) -> None:
    [prompt] = prompts_of([40])

    async def main():
        async with Cluster(tiny_llama, threshold=8) as c:
            cached = []
            for salt in ("a", "a", "b", None, None):
                params = SamplingParams(max_tokens=2, temperature=0, cache_salt=salt)
                async for out in c.engine.generate(prompt, params):
                    last = out
                cached.append(last.num_cached_tokens)
            return cached

    # 40 tokens in blocks of 8: the 4 full blocks before the last token hit.
    assert asyncio.run(main()) == [0, 32, 0, 0, 32]
