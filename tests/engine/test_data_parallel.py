"""Data-parallel attention for a mixture of experts (engine/data_parallel.py): `LLM(...,
data_parallel_size=2, expert_parallel_size=2)` runs two engine ranks, each with its own requests
and KV cache and half of the routed experts, in lockstep; a rank with nothing to run serves its
experts. Greedy tokens and their logprobs equal one rank's (fp32), with requests of different
lengths (one rank idles while the other finishes) and a later call that leaves a rank idle
throughout; the follower exits cleanly; bad layouts are refused naming the field."""

from __future__ import annotations

import pytest

from duet.engine import LLM, InvalidInputError, SamplingParams
from duet.engine.async_engine import AsyncEngine
from duet.engine.config import EngineConfig
from duet.engine.llm_engine import LLMEngine

PROMPTS = [[5, 9, 17], list(range(40, 51)), [300, 7], list(range(60, 120)), [7] * 9]
MAX_TOKENS = (8, 3, 12, 5, 9)


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in MAX_TOKENS
    ]


def _results(outs):
    return [
        (o.outputs[0].token_ids, [lp.sampled.logprob for lp in o.outputs[0].logprobs]) for o in outs
    ]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_two_ranks_give_one_ranks_tokens(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    one = LLM(path, dtype="float32", load_progress=False)
    want = _results(one.generate(PROMPTS, _params()))
    two = LLM(
        path, dtype="float32", load_progress=False, data_parallel_size=2, expert_parallel_size=2
    )
    try:
        assert _results(two.generate(PROMPTS, _params())) == want
        # the requests were shared out: this rank ran some of them, not all
        own = two.engine.stats.num_prompt_tokens
        assert 0 < own < sum(map(len, PROMPTS))
        # one request: the other rank has nothing of its own and serves its experts each step
        assert _results(two.generate(PROMPTS[3:4], _params()[3:4])) == want[3:4]
    finally:
        two.shutdown()
    (follower,) = two.follower_processes
    assert follower.wait(timeout=30) == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(data_parallel_size=2, expert_parallel_size=1), "expert_parallel_size"),
        (dict(data_parallel_size=2, expert_parallel_size=2, tensor_parallel_size=2), "data_parallel_size"),
        (dict(data_parallel_size=2, expert_parallel_size=2, pipeline_parallel_size=2), "data_parallel_size"),
        (dict(data_parallel_size=0), "data_parallel_size"),
        (
            dict(data_parallel_size=2, expert_parallel_size=2,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
            "data_parallel_size",
        ),
    ],
)  # fmt: skip
def test_bad_layouts_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(InvalidInputError) as e:
        EngineConfig.from_kwargs(**kwargs)
    assert e.value.field == field


def test_a_dense_model_is_refused_before_any_rank_starts(tiny_llama):
    with pytest.raises(InvalidInputError) as e:
        LLM(tiny_llama, load_progress=False, data_parallel_size=2, expert_parallel_size=2)
    assert e.value.field == "data_parallel_size" and "dense" in e.value.message


def test_only_the_offline_llm_starts_data_parallel_ranks(tiny_model_factory):
    path = tiny_model_factory("qwen3_moe")
    config = EngineConfig.from_kwargs(
        model=path, load_progress=False, data_parallel_size=2, expert_parallel_size=2
    )
    with pytest.raises(InvalidInputError) as e:
        AsyncEngine.from_config(config)  # duet serve's engine
    assert e.value.field == "data_parallel_size" and "offline" in e.value.message
    with pytest.raises(InvalidInputError) as e:
        LLMEngine(config)  # a worker's engine, given no ranks to exchange with
    assert e.value.field == "data_parallel_size"
