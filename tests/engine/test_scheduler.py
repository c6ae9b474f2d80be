"""Scheduler policy through LLMEngine steps: budgets, max_num_seqs, priority, aborts."""

from __future__ import annotations

import pytest

from duet.engine import EngineConfig, LLMEngine, SamplingParams
from duet.engine.request import RequestStatus


def make_engine(model: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype="float32", load_progress=False, **kwargs))


PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_token_budget_chunks_prefill_and_mixes_decodes(tiny_llama):
    engine = make_engine(tiny_llama, max_num_batched_tokens=16)
    engine.add_request([7] * 5, PARAMS, request_id="short")
    engine.add_request([9] * 40, PARAMS, request_id="long")
    first = engine.scheduler.schedule()
    assert [(r.request_id, n) for r, n in first.scheduled] == [("short", 5), ("long", 11)]
    engine.runner.execute(first, engine.kv)
    engine.scheduler.update_from_output(first, {"short": [3]})
    second = engine.scheduler.schedule()
    # The short request decodes one token; the long one continues its prefill in the rest.
    assert [(r.request_id, n) for r, n in second.scheduled] == [("short", 1), ("long", 15)]
    assert second.num_batched_tokens == 16


def test_max_num_seqs_limits_running(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=2)
    for i in range(4):
        engine.add_request([5 + i] * 8, PARAMS, request_id=f"r{i}")
    out = engine.scheduler.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"]
    assert len(engine.scheduler.waiting) == 2


def test_priority_policy_runs_lower_value_first(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=1, scheduling_policy="priority")
    engine.add_request([5] * 8, PARAMS, request_id="late", priority=5)
    engine.add_request([6] * 8, PARAMS, request_id="urgent", priority=-1)
    out = engine.scheduler.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["urgent"]


def test_fcfs_ignores_priority(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=1)
    engine.add_request([5] * 8, PARAMS, request_id="first", priority=5)
    engine.add_request([6] * 8, PARAMS, request_id="second", priority=-1)
    assert [r.request_id for r, _ in engine.scheduler.schedule().scheduled] == ["first"]


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding"])
def test_abort_at_any_time_frees_blocks(tiny_llama, when):
    engine = make_engine(tiny_llama, max_num_batched_tokens=16, num_kv_blocks=32)
    engine.add_request([4] * 40, SamplingParams(max_tokens=50, ignore_eos=True), request_id="x")
    engine.add_request([3] * 4, PARAMS, request_id="other")
    steps = {"waiting": 0, "prefilling": 1, "decoding": 4}[when]
    for _ in range(steps):
        engine.step()
    request = engine.scheduler.requests["x"]
    out = engine.abort_request("x")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert engine.kv.get_block_ids("x") == []
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_free_blocks == 32
    assert engine.abort_request("x") is None  # already gone: a no-op


def test_preempted_request_resumes_with_same_output(tiny_llama):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[11 + i] * 30 for i in range(4)]
    roomy = make_engine(tiny_llama)
    tight = make_engine(tiny_llama, num_kv_blocks=12, block_size=8)
    results = []
    for engine in (roomy, tight):
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=str(i))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        results.append(done)
    assert tight.scheduler.num_preemptions > 0
    assert results[0] == results[1]
    assert tight.kv.num_free_blocks == 12
