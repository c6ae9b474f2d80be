"""Expert load (issue 44 item 5): the tokens each routed expert received, counted by the engine,
equal a count from HF transformers' router logits on the same sequences; the step imbalance is
max over mean of the step's counts, averaged over sparse layers; a dense model counts nothing."""

from __future__ import annotations

import pytest
import torch

from duet.engine import LLM, SamplingParams
from duet.engine.model.expert_load import imbalance
from tests.conftest import MOE_ARCHS

PROMPTS = [[5, 9, 200, 31, 7, 77, 300, 12, 4], [400, 3, 18, 250, 61], [90, 91, 92]]
MAX_TOKENS = 6


def hf_expert_counts(model_dir: str, sequences: list[list[int]], top_k: int) -> torch.Tensor:
    """[L, E]: each sparse layer's top-k choices from HF's router logits, counted per expert."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total = None
    with torch.no_grad():
        for seq in sequences:
            logits = hf(torch.tensor([seq]), output_router_logits=True).router_logits
            counts = torch.stack([
                torch.bincount(torch.softmax(layer.float(), -1).topk(top_k, -1).indices.reshape(-1),
                               minlength=layer.shape[-1])
                for layer in logits
            ])  # fmt: skip
            total = counts if total is None else total + counts
    assert total is not None
    return total


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_counts_match_hf_router(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    llm = LLM(model_dir, dtype="float32", load_progress=False, num_kv_blocks=64,
              enable_prefix_caching=False)  # fmt: skip
    engine = llm.engine
    moe = engine.runner.model.config.moe
    assert moe is not None
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    stats = engine.stats
    num_sparse = {"mixtral": 2, "qwen2_moe": 2, "qwen3_moe": 2}[arch]
    # every computed token: the prompts and each output token but the last
    num_tokens = sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS)
    assert stats.iteration_tokens_sum == num_tokens
    assert stats.moe_layer_expert_tokens is not None and stats.moe_expert_tokens is not None
    assert len(stats.moe_layer_expert_tokens) == num_sparse
    assert sum(stats.moe_expert_tokens) == num_tokens * moe.num_experts_per_tok * num_sparse
    sequences = [p + o[:-1] for p, o in zip(PROMPTS, outs, strict=True)]
    ref = hf_expert_counts(model_dir, sequences, moe.num_experts_per_tok)
    assert stats.moe_layer_expert_tokens == ref.tolist()
    assert stats.moe_expert_tokens == ref.sum(0).tolist()


def test_step_imbalance_is_max_over_mean(tiny_model_factory):
    llm = LLM(tiny_model_factory("qwen3_moe"), dtype="float32", load_progress=False,
              num_kv_blocks=64)  # fmt: skip
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, params, request_id=str(i))
    before = torch.zeros(2, 16, dtype=torch.int64)
    num_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        after = torch.tensor(engine.stats.moe_layer_expert_tokens)
        step = (after - before).double()  # [L, E]
        expected = (step.max(1).values / step.mean(1)).mean().item()
        assert engine.stats.moe_expert_imbalance == pytest.approx(expected, rel=1e-12)
        assert engine.stats.moe_expert_imbalance >= 1.0
        before, num_steps = after, num_steps + 1
    assert num_steps == 4  # one prefill step for the three prompts, then three decodes


def test_imbalance_of_known_counts():
    assert imbalance([[2, 2, 2, 2]]) == 1.0
    assert imbalance([[8, 0, 0, 0]]) == 4.0
    assert imbalance([[8, 0, 0, 0], [2, 2, 2, 2]]) == 2.5
    assert imbalance([[0, 0], [3, 1]]) == 1.5  # a layer that routed nothing is left out
    assert imbalance([[0, 0]]) == 0.0


def test_dense_model_counts_nothing(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", load_progress=False, num_kv_blocks=64)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert llm.engine.runner.expert_load is None
    assert llm.engine.stats.moe_expert_tokens is None
    assert llm.engine.stats.moe_expert_imbalance == 0.0
