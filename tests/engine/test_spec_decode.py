"""Speculative decoding (ngram) end to end on tiny random models: the same tokens as without
it, stops mid-speculation, and the KV pool and prefix cache after a rough workload."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from duet.engine import LLM, SamplingParams
from duet.engine.block_pool import hash_request_blocks
from duet.engine.errors import InvalidInputError
from duet.engine.llm_engine import LLMEngine
from duet.engine.outputs import RequestOutput

# A repetitive prompt the tiny llama answers with a run of one token (proposals accepted), one
# it answers without repeats (proposals rejected), repeated patterns, and long prompts that
# are prefilled in chunks next to speculating decodes.
PROMPTS: list[list[int]] = [
    [5, 6, 7, 8, 9] * 6,
    [11, 12, 13] * 10,
    list(range(20, 60)),
    [3, 4] * 15,
    [100 + i % 7 for i in range(33)],
    [(i * 37) % 500 + 3 for i in range(150)],
    [42] * 20,
    [(i * 11) % 300 + 5 for i in range(90)],
]


def _ngram(k: int) -> dict:
    # Batches above the CPU's default of 4 decoding requests speculate too (they are the test).
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "disable_by_batch_size": 64}  # fmt: skip


def _llm(model: str, dtype: str, spec: dict | None = None, **kwargs) -> LLM:
    kwargs.setdefault("deterministic", True)  # bf16 equality needs it on CUDA too
    return LLM(
        model, dtype=dtype, load_progress=False, max_num_batched_tokens=64,
        speculative_config=spec, **kwargs,
    )  # fmt: skip


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_with_ngram_equals_greedy_without(tiny_llama, dtype):
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    reference = _tokens(_llm(tiny_llama, dtype).generate(PROMPTS, params))
    for k in (1, 3, 5):
        llm = _llm(tiny_llama, dtype, _ngram(k))
        assert _tokens(llm.generate(PROMPTS, params)) == reference, f"k={k}"
        stats = llm.engine.stats.spec_decode
        assert stats is not None
        assert stats.num_accepted_tokens > 0, f"k={k}: no proposal was accepted"
        assert stats.num_draft_tokens > stats.num_accepted_tokens, f"k={k}: none rejected"
        assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
        if k > 1:
            assert stats.num_accepted_tokens_per_pos[k - 1] > 0  # whole runs accepted


def test_seeded_sampling_with_ngram_equals_without(tiny_llama):
    """Verification draws each row as a plain decode draws that token, so seeded sampling
    (temperature, top-k/p, min-p, penalties) gives the same text with speculation."""
    kinds = [
        SamplingParams(temperature=0.05, seed=1),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=2),
        SamplingParams(temperature=0.1, min_p=0.1, seed=3, logprobs=2),
        SamplingParams(temperature=0.4, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.1, seed=4),
        SamplingParams(temperature=0.6, min_tokens=12, stop_token_ids=[356], seed=5),
    ]  # fmt: skip
    params = [replace(kinds[i % len(kinds)], max_tokens=32, ignore_eos=True) for i in range(8)]
    reference = _llm(tiny_llama, "float32").generate(PROMPTS, params)
    llm = _llm(tiny_llama, "float32", _ngram(4))
    outputs = llm.generate(PROMPTS, params)
    assert _tokens(outputs) == _tokens(reference)
    for got, want in zip(outputs, reference, strict=True):
        if want.outputs[0].logprobs is not None:
            assert got.outputs[0].logprobs is not None
            assert [lp.sampled.token_id for lp in got.outputs[0].logprobs] == got.outputs[
                0
            ].token_ids
            for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
                assert abs(a.sampled.logprob - b.sampled.logprob) < 1e-4
    assert llm.engine.stats.spec_decode.num_accepted_tokens > 0


def test_stops_inside_accepted_runs(tiny_llama):
    """max_tokens, stop tokens and stop strings that fall inside a step's accepted tokens end
    the output exactly where they do without speculation: no token past a stop."""
    base = _llm(tiny_llama, "float32")
    run_token = _tokens(base.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0)))[
        0
    ][-1]
    text = base.tokenizer.decode([run_token])
    cases = [
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, min_tokens=6, stop_token_ids=[run_token]),
        SamplingParams(max_tokens=30, temperature=0, stop=[text * 9]),
        SamplingParams(max_tokens=30, temperature=0, stop=[text * 4], min_tokens=5),
    ]
    spec = _llm(tiny_llama, "float32", _ngram(5))
    for params in cases:
        want = base.generate([PROMPTS[0]], params)[0].outputs[0]
        got = spec.generate([PROMPTS[0]], params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason
        )  # fmt: skip
        assert len(got.token_ids) < 30
    assert spec.engine.stats.spec_decode.num_accepted_tokens_per_pos[4] > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_pool_and_prefix_cache_after_rejections_aborts_and_preemptions(tiny_llama, method):
    """A pool too small for the batch (preemptions), proposals rejected and accepted, two
    requests aborted mid-speculation: every block ends back in the pool, blocks never
    outgrow what a request's tokens need after a step, and the prefix cache holds only
    blocks of real sequences. Then prompts that continue those sequences hit the cache and
    generate what a fresh engine without speculation generates (no stale KV was cached)."""
    spec = _ngram(5)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    if method == "draft_model":
        # The target as its own (greedy) draft, sampled at temperature 0.7: guesses are both
        # accepted and rejected.
        spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}
        params = SamplingParams(max_tokens=48, temperature=0.7, seed=3, ignore_eos=True)
    engine = LLMEngine(_llm(tiny_llama, "float32", spec, num_kv_blocks=40, block_size=8).config)
    kv, bs = engine.kv, 8
    ids = [engine.add_request(p, params) for p in PROMPTS]
    sequences: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                sequences[out.request_id] = out.prompt_token_ids + out.outputs[0].token_ids
        steps += 1
        for request in engine.scheduler.running:
            assert len(kv.req_to_blocks[request.request_id]) <= kv.num_blocks_for(
                request.num_tokens
            ), request
        if steps == 12:
            for request_id in (ids[1], ids[6]):
                out = engine.abort_request(request_id)
                assert out is not None and out.outputs[0].finish_reason == "abort"
                sequences[request_id] = out.prompt_token_ids + out.outputs[0].token_ids
    stats = engine.stats.spec_decode
    assert stats is not None
    assert engine.scheduler.num_preemptions > 0
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    assert kv.num_free_blocks == engine.num_blocks
    if method == "draft_model":  # the draft's pool too: every shadow released
        assert engine.speculator is not None
        draft_kv = engine.speculator.proposer.kv  # type: ignore[attr-defined]
        assert draft_kv.num_free_blocks == engine.num_blocks and not draft_kv.req_to_blocks
    assert all(block.ref_cnt == 0 for block in kv.pool.blocks)
    real: set = set()
    for tokens in sequences.values():
        hashes: list = []
        hash_request_blocks(tokens, bs, hashes)
        real.update(hashes)
    cached = set(kv.pool._cached)
    assert cached and cached <= real

    fresh = _llm(tiny_llama, "float32", num_kv_blocks=400, block_size=8)
    prompt_len = {i: len(p) for i, p in zip(ids, PROMPTS, strict=True)}
    # Requests that ran to the end (preempted and recomputed or not) generated what an engine
    # without speculation generates.
    want = fresh.generate(PROMPTS, params)
    for request_id, prompt, w in zip(ids, PROMPTS, want, strict=True):
        if request_id not in (ids[1], ids[6]):
            assert sequences[request_id] == prompt + w.outputs[0].token_ids, request_id

    # Continuations of the sequences the cache holds most of, one at a time: they hit blocks
    # of generated tokens (computed with guesses in flight) and must generate what a fresh
    # engine generates.
    for _ in range(2):
        cached = set(kv.pool._cached)
        leading = {}
        for request_id, tokens in sequences.items():
            hashes = []
            hash_request_blocks(tokens, bs, hashes)
            leading[request_id] = next(
                (n for n, h in enumerate(hashes) if h not in cached), len(hashes)
            )
        best = max(leading, key=lambda r: leading[r])
        prompt = sequences.pop(best)
        expected_hits = min(leading[best], (len(prompt) - 1) // bs) * bs
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        assert expected_hits > prompt_len[best]  # blocks of generated tokens among the hits
        hits_before = kv.prefix_stats.num_hits
        outputs = []
        engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        assert kv.prefix_stats.num_hits - hits_before == expected_hits
        assert _tokens(outputs) == _tokens(fresh.generate([prompt], params))


# -- draft_model ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_greedy_with_a_draft_model_equals_greedy_without(tiny_llama, tiny_model_factory):
    """A 1-layer draft with the target's tokenizer: same tokens as no speculation. The target
    as its own draft: every guess accepted."""
    draft = tiny_model_factory("llama", num_hidden_layers=1)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reference = _tokens(_llm(tiny_llama, "float32").generate(PROMPTS, params))
    for model, k in ((draft, 3), (tiny_llama, 4)):
        config = {"method": "draft_model", "model": model, "num_speculative_tokens": k}
        llm = _llm(tiny_llama, "float32", config)
        assert _tokens(llm.generate(PROMPTS, params)) == reference, model
        stats = llm.engine.stats.spec_decode
        assert stats is not None and stats.num_draft_tokens > 0
        if model == tiny_llama:
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        else:
            assert stats.num_draft_tokens > stats.num_accepted_tokens


def test_a_draft_model_is_loaded_once_and_its_pool_shares_the_budget(
    tiny_llama, tiny_model_factory, monkeypatch
):
    """The engine loads the draft before sizing the KV pool (on CUDA its weights are then in
    the measurement) and hands it to the proposer: one load. The pools of both models, as
    many blocks each, fit `kv_cache_memory_bytes` together."""
    from duet.engine.spec_decode import draft_model

    draft = tiny_model_factory("llama", num_hidden_layers=1)
    loads: list[str] = []
    load = draft_model.load_model

    def counted(path, *args, **kwargs):
        loads.append(path)
        return load(path, *args, **kwargs)

    monkeypatch.setattr(draft_model, "load_model", counted)
    budget = 1 << 20
    config = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    llm = _llm(tiny_llama, "float32", config, kv_cache_memory_bytes=budget)
    assert loads == [draft]
    engine = llm.engine
    target = engine.runner.model
    proposer = engine.speculator.proposer
    block = target.kv_spec.bytes_per_block(target.num_layers, 16, torch.float32)
    draft_model_ = proposer.runner.model
    draft_block = draft_model_.kv_spec.bytes_per_block(draft_model_.num_layers, 16, torch.float32)
    assert engine.num_blocks == budget // (block + draft_block) < budget // block
    assert proposer.kv.pool.num_blocks == engine.num_blocks


def test_draft_model_with_another_vocabulary_is_refused(tiny_llama, tiny_model_factory):
    draft = tiny_model_factory("llama", vocab_size=600)
    with pytest.raises(InvalidInputError) as info:
        _llm(tiny_llama, "float32", {"method": "draft_model", "model": draft})
    assert info.value.field == "speculative_config"
    assert "has a vocabulary of 600 tokens" in info.value.message
    assert "must share the target's tokenizer" in info.value.message


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grammar_requests_speculate_with_vetted_guesses(tiny_llama, dtype):
    """Requests with a grammar speculate too: each guess is cut at the first token the
    grammar refuses, and each verification row is masked by the grammar after the guesses
    before it. Same tokens as without speculation, a plain request beside them (more
    sampling rows than sequence slots), guesses accepted, and the grammar's output valid."""
    import re

    from duet.engine.structured_output import StructuredOutputsParams

    regex = r"[a-c]{2,5}-\d{1,3}"
    repeat = r"(ab|ba|c){8,30}"
    params = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0,
                       structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(max_tokens=40, temperature=0,
                       structured_outputs=StructuredOutputsParams(regex=repeat)),
    ]  # fmt: skip
    prompts = [PROMPTS[0], PROMPTS[6], PROMPTS[3]]
    want = _llm(tiny_llama, dtype, max_num_seqs=3).generate(prompts, params)
    llm = _llm(tiny_llama, dtype, _ngram(5), max_num_seqs=3)
    got = llm.generate(prompts, params)
    assert _tokens(got) == _tokens(want)
    assert got[1].outputs[0].finish_reason == "stop"
    assert re.fullmatch(regex, got[1].outputs[0].text)
    assert re.fullmatch(repeat, got[2].outputs[0].text)
    assert llm.engine.stats.spec_decode.num_accepted_tokens_per_pos[4] > 0
    # The grammar requests alone: their own guesses are verified and accepted.
    alone = _llm(tiny_llama, dtype, _ngram(3), max_num_seqs=2)
    assert _tokens(alone.generate(prompts[1:], params[1:])) == _tokens(want[1:])
    assert alone.engine.stats.spec_decode.num_accepted_tokens > 0
