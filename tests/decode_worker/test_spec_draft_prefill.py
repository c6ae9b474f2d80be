"""A draft model on a decode worker fed by a prefill worker, with the draft's prompt KV
computed on either side (`speculative_config`'s `draft_prefill`): the tokens are those of an
aggregated engine without speculation, fp32 and bf16; the draft's KV that arrives from the
prefill worker equals, bit for bit, what the decode worker computes itself; every block of
both pools of both workers is free afterwards; a bad value names its key."""

from __future__ import annotations

import asyncio

import pytest
import torch

from duet.decode_worker.config import DecodeWorkerConfig
from duet.engine import LLM, SamplingParams
from duet.engine.errors import InvalidInputError
from duet.engine.spec_decode.draft_model import DraftModelProposer
from duet.kv_transfer.layout import DraftLayout
from tests.decode_worker.test_remote_decode import ENGINE, disaggregated, start_workers

PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 10, list(range(20, 60)), [42] * 20,
           [(i * 37) % 500 + 3 for i in range(70)], [(i * 11) % 400 + 7 for i in range(150)]]  # fmt: skip
BUDGET = 64  # max_num_batched_tokens: the longest prompts are prefilled in several chunks


@pytest.fixture(scope="module")
def draft(tiny_model_factory):
    """One layer, 1 KV head of 32 (the targets': 2 of 16, or 3 of 64): the draft's layout is
    its own."""
    return tiny_model_factory(
        "llama", num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )


def target_of(request, dtype):
    return request.getfixturevalue("tiny_llama" if dtype == "float32" else "smollm2_shaped")


def spec(draft, where, **extra):
    """The draft model's config. `disable_by_batch_size` covers every prompt: on a CPU it is 4
    when unset, and on a loaded machine all six prompts reached the decode worker together,
    so no step proposed (num_draft_tokens 0: a flaky failure)."""
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
            "draft_prefill": where, "disable_by_batch_size": len(PROMPTS), **extra}  # fmt: skip


def proposers(prefill, decode) -> list[DraftModelProposer]:
    """The draft on each side that has one."""
    out = []
    for engine in (prefill.engine, decode.engine):
        if engine.speculator is not None:
            assert isinstance(engine.speculator.proposer, DraftModelProposer)
            out.append(engine.speculator.proposer)
    return out


def assert_all_pools_whole(prefill, decode):
    for engine in (prefill.engine, decode.engine):
        assert engine.kv.num_free_blocks == engine.num_blocks
    for proposer in proposers(prefill, decode):
        assert proposer.kv.num_free_blocks == proposer.target.num_blocks
        assert not proposer.kv.req_to_blocks and not proposer._shadows


def run_all(prefill, decode, prompts, params):
    async def run():
        return await asyncio.gather(
            *(disaggregated(prefill, decode, f"r{i}", p, params) for i, p in enumerate(prompts))
        )

    return asyncio.run(run())


def block_bytes(caches):
    return sum(c.nbytes // c.shape[1] for c in caches)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("where", ["decode", "prefill"])
def test_greedy_with_a_draft_equals_aggregated_without(request, draft, dtype, where):
    target = target_of(request, dtype)
    engine = {**ENGINE, "dtype": dtype, "max_num_batched_tokens": BUDGET}
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = LLM(target, **engine).generate(PROMPTS, params)
    prefill, decode = start_workers(target, "tcp", speculative_config=spec(draft, where), **engine)
    try:
        results = run_all(prefill, decode, PROMPTS, params)
        assert [outs[-1].token_ids for _, outs in results] == [w.token_ids for w in want]
        stats = decode.engine.stats.spec_decode
        assert stats is not None and stats.num_draft_tokens > 0
        # The prefill worker loads the draft only to prefill it; the channel carries its layers.
        [decode_draft, *prefill_draft] = proposers(prefill, decode)[::-1]
        target_bytes = block_bytes(prefill.engine.runner.kv_caches)
        draft_bytes = block_bytes(decode_draft.runner.kv_caches) if where == "prefill" else 0
        for prompt, (result, _) in zip(PROMPTS, results, strict=True):
            num_blocks = -(-len(prompt) // ENGINE["block_size"])
            assert result.num_transfer_bytes == num_blocks * (target_bytes + draft_bytes)
        if where == "prefill":
            assert len(prefill_draft) == 1
            assert decode.layout.draft == prefill.layout.draft == DraftLayout(draft, 1, 1, 32)
        else:
            assert prefill_draft == [] and decode.layout.draft is None is prefill.layout.draft
        assert_all_pools_whole(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def prompt_kv(proposer, request_id, num_tokens):
    """The draft's KV at a request's first `num_tokens` positions: [2, n, heads, dim] a layer."""
    ids = proposer.kv.get_block_ids(request_id)
    return [c[:, ids].flatten(1, 2)[:, :num_tokens].clone() for c in proposer.runner.kv_caches]


def spy_draft(decode, prompts):
    """Spy on the decode worker's draft: the prompt KV of each request as it arrived from the
    prefill worker (`prompt_received`), or as the draft computed it here (read when the
    shadow is released), and the most tokens one of its passes computed for a request."""
    proposer = decode.engine.speculator.proposer
    received, release, run = proposer.prompt_received, proposer.release, proposer._run
    seen = {"arrived": {}, "computed": {}, "most_new": 0}

    def on_received(request_id, ok):
        assert ok
        num = len(prompts[int(request_id[1:])])
        seen["arrived"][request_id] = prompt_kv(proposer, request_id, num)
        received(request_id, ok)
        assert proposer._shadows[request_id].num_computed_tokens == num

    def on_release(request_id):
        if request_id not in seen["arrived"] and proposer.kv.get_block_ids(request_id):
            num = len(prompts[int(request_id[1:])])
            seen["computed"][request_id] = prompt_kv(proposer, request_id, num)
        release(request_id)

    def on_run(batch):
        seen["most_new"] = max([seen["most_new"]] + [n for _, n in batch])
        return run(batch)

    proposer.prompt_received, proposer.release, proposer._run = on_received, on_release, on_run
    return seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transferred_draft_kv_equals_the_decode_workers_own(request, draft, dtype):
    """The draft's prompt KV as it lands from the prefill worker (chunks of the prompt) is the
    KV the decode worker's draft computes itself (prompt and first token together), bit for
    bit; with it, the decode side's draft never computes a prompt (at most k + 1 = 4 tokens a
    request a pass)."""
    target = target_of(request, dtype)
    engine = {**ENGINE, "dtype": dtype, "max_num_batched_tokens": BUDGET}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = PROMPTS[2:]
    ids = [f"r{i}" for i in range(len(prompts))]
    seen = {}
    for where in ("decode", "prefill"):
        prefill, decode = start_workers(
            target, "tcp", speculative_config=spec(draft, where), **engine
        )
        try:
            seen[where] = spy_draft(decode, prompts)
            run_all(prefill, decode, prompts, params)
            assert_all_pools_whole(prefill, decode)
        finally:
            prefill.shutdown()
            decode.shutdown()
    local, shipped = seen["decode"], seen["prefill"]
    assert (sorted(local["computed"]), local["arrived"]) == (ids, {})
    assert (sorted(shipped["arrived"]), shipped["computed"]) == (ids, {})
    assert local["most_new"] >= min(len(p) for p in prompts) > 4 >= shipped["most_new"]
    for request_id in ids:
        pairs = zip(local["computed"][request_id], shipped["arrived"][request_id], strict=True)
        for here, there in pairs:
            assert torch.equal(here, there), request_id


def test_auto_ships_the_draft_for_long_prompts_only(tiny_llama, draft):
    engine = {**ENGINE, "max_num_batched_tokens": BUDGET}
    config = spec(draft, "auto", draft_prefill_min_tokens=40)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = LLM(tiny_llama, **engine).generate(PROMPTS, params)
    prefill, decode = start_workers(tiny_llama, "tcp", speculative_config=config, **engine)
    try:
        results = run_all(prefill, decode, PROMPTS, params)
        assert [outs[-1].token_ids for _, outs in results] == [w.token_ids for w in want]
        target_bytes = block_bytes(prefill.engine.runner.kv_caches)
        draft_bytes = block_bytes(decode.engine.speculator.proposer.runner.kv_caches)
        for prompt, (result, _) in zip(PROMPTS, results, strict=True):
            num_blocks = -(-len(prompt) // ENGINE["block_size"])
            shipped = draft_bytes if len(prompt) >= 40 else 0
            assert result.num_transfer_bytes == num_blocks * (target_bytes + shipped)
        assert_all_pools_whole(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"draft_prefill": "both"},
         "'draft_prefill' must be one of decode, prefill, auto; got 'both'"),
        ({"draft_prefill": "prefill", "draft_prefill_min_tokens": 64},
         "'draft_prefill_min_tokens' applies to draft_prefill auto only; got it with 'prefill'"),
        ({"draft_prefill": "auto", "draft_prefill_min_tokens": 0},
         "'draft_prefill_min_tokens' must be an integer in [1, 16777216]; got 0"),
    ],
)  # fmt: skip
def test_a_bad_draft_prefill_names_the_key(tiny_llama, draft, extra, message):
    with pytest.raises(InvalidInputError) as info:
        DecodeWorkerConfig(model=tiny_llama, speculative_config={**spec(draft, "decode"), **extra})
    assert info.value.field == "speculative_config"
    assert message in str(info.value)
