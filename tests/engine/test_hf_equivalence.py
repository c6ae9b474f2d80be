"""Greedy tokens and logprobs against HF transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from duet.engine import LLM, SamplingParams

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "smollm2"]
PROMPT_LENS = [5, 17, 33, 64, 100, 130, 7, 48, 250, 1]
MAX_TOKENS = 24


def make_prompts(lengths=PROMPT_LENS, vocab=512, seed=0, prefix: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for n in lengths:
        body = torch.randint(3, vocab, (n,), generator=g).tolist()
        prompts.append((prefix or []) + body)
    return prompts


def hf_greedy(model_dir: str, prompts, max_tokens=MAX_TOKENS):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(
                torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long),
            )  # fmt: skip
            out.append(ids[0, len(p) :].tolist())
    return out


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    prompts = make_prompts()
    expected = hf_greedy(model_dir, prompts)
    llm = LLM(model_dir, dtype="float32", load_progress=False)
    assert llm.engine.runner.use_decode_kernel  # the C++ CPU kernel built and is in use
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_torch_attention_path_matches_hf(tiny_model_factory, arch):
    # The reference attention (length-bucketed SDPA) instead of the C++ decode kernel.
    model_dir = tiny_model_factory(arch)
    prompts = make_prompts()
    llm = LLM(model_dir, dtype="float32", attention_backend="torch", load_progress=False)
    assert not llm.engine.runner.use_decode_kernel
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == hf_greedy(model_dir, prompts)


@pytest.fixture(scope="module")
def llama_reference(tiny_llama):
    prompts = make_prompts()
    return prompts, hf_greedy(tiny_llama, prompts)


def test_preemption_keeps_tokens_identical(tiny_llama, llama_reference):
    prompts, expected = llama_reference
    # 30 blocks of 16 tokens cannot hold all 10 requests as they grow: some are preempted.
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=30, block_size=16, load_progress=False)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.kv.num_free_blocks == 30


def test_chunked_prefill_keeps_tokens_identical(tiny_llama, llama_reference):
    prompts, expected = llama_reference
    llm = LLM(tiny_llama, dtype="float32", max_num_batched_tokens=32, load_progress=False)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected


def test_prefix_cache_hits_and_identical_tokens(tiny_llama):
    shared = make_prompts([96], seed=7)[0]
    prompts = make_prompts([3, 20, 45, 9, 70, 1, 33, 12], seed=8, prefix=shared)
    expected = hf_greedy(tiny_llama, prompts)
    no_cache = LLM(tiny_llama, dtype="float32", enable_prefix_caching=False, load_progress=False)
    assert [o.token_ids for o in no_cache.generate(prompts, GREEDY)] == expected

    llm = LLM(tiny_llama, dtype="float32", load_progress=False)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    assert [o.token_ids for o in first + rest] == expected
    # Every later prompt reuses the 6 full blocks of the shared 96-token prefix.
    assert all(o.num_cached_tokens == 96 for o in rest)
    assert llm.engine.kv.prefix_stats.num_hits >= 96 * len(rest)


def test_logprobs_match_hf_log_softmax(tiny_llama):
    from transformers import AutoModelForCausalLM

    prompts = make_prompts([12, 40, 77], seed=3)
    llm = LLM(tiny_llama, dtype="float32", load_progress=False)
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    )
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    for prompt, out in zip(prompts, outs, strict=True):
        full = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = hf(full).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits.float(), dim=-1)
        assert len(out.logprobs) == 8
        for step, lp in enumerate(out.logprobs):
            assert lp.sampled.token_id == out.token_ids[step]
            assert abs(lp.sampled.logprob - ref[step, lp.sampled.token_id].item()) < 1e-3
            top_ids = ref[step].topk(5).indices.tolist()
            assert [t.token_id for t in lp.top] == top_ids
            for t in lp.top:
                assert abs(t.logprob - ref[step, t.token_id].item()) < 1e-3
