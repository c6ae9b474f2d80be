"""Mixtures of experts (issue 44): Mixtral, Qwen2-MoE and Qwen3-MoE against HF transformers on
the same random weights (fp32: greedy tokens and top-5 logprobs), the router against HF's
routers, and batch invariance in bf16 and fp32: a token's output does not depend on which other
tokens its experts received, alone or in a batch, chunked or whole, after a prefix hit or cold."""

from __future__ import annotations

import random

import pytest
import torch

from duet.engine import LLM, SamplingParams
from duet.engine.model import ModelArchConfig, row_invariant
from duet.engine.model.dense_cpu_linear import use_dense_kernel, use_dense_kernel_pairs
from duet.engine.model.moe import SparseMoeBlock, route
from duet.engine.model.packed_linear import pack_linears
from duet.engine.parallel import SINGLE
from tests.conftest import ARCH_CONFIGS, MOE_ARCHS
from tests.engine.test_batch_invariance import (
    PARAMS,
    _prompt,
    _result,
    assert_alone_batched_chunked_and_hits_equal,
)

NUM_PROMPTS, MAX_TOKENS = 8, 32
PROMPT_LENS = [5, 17, 33, 64, 100, 7, 48, 1]

MOE_SHAPES = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    moe_intermediate_size=256,
    initializer_range=0.05,
)
"""Wider than the tiny models (whose shapes hide the linear kernels' row-count paths) and still
fast: 64-wide heads for the attention kernels, 256-wide experts."""


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_logprobs(model_dir: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The log-softmax of HF's logits at every position of each sequence ([len, vocab])."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [torch.log_softmax(hf(torch.tensor([s])).logits[0].float(), -1) for s in sequences]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_tokens_and_top5_logprobs_match_hf(tiny_model_factory, arch):
    """HF scores duet's prompt + output in one forward pass: every output token is HF's argmax
    after the tokens before it (so the sequence is HF's greedy one), and each step's top 5 are
    HF's, their logprobs within 1e-4."""
    model_dir = tiny_model_factory(arch)
    prompts = _prompts()
    assert len(prompts) == NUM_PROMPTS
    llm = LLM(model_dir, dtype="float32", load_progress=False, num_kv_blocks=64)
    assert llm.engine.runner.model.config.moe is not None
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    refs = hf_logprobs(model_dir, [p + o.token_ids for p, o in zip(prompts, outs, strict=True)])
    for prompt, sample, ref in zip(prompts, outs, refs, strict=True):
        steps = ref[len(prompt) - 1 : -1]  # [MAX_TOKENS, vocab]: what predicts each output
        assert sample.token_ids == steps.argmax(-1).tolist()
        assert len(sample.logprobs) == MAX_TOKENS
        for lp, step in zip(sample.logprobs, steps, strict=True):
            top = step.topk(5)
            assert [t.token_id for t in lp.top] == top.indices.tolist()
            got = torch.tensor([t.logprob for t in lp.top])
            torch.testing.assert_close(got, top.values, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("arch", "top_k"), [*((a, 2) for a in MOE_ARCHS), ("qwen3_moe", 8)], ids=str
)
def test_router_matches_hf(arch, top_k):
    """Weights and experts as HF's router gives them, with the choices in expert order
    (bitwise at top-2; at Qwen3-MoE's top-8 the renormalising sum may add in another order)."""
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    spec = {**ARCH_CONFIGS[arch], "hidden_size": 64, "num_experts_per_tok": top_k}
    model_type = spec.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **spec)
    router_class = {"mixtral": MixtralTopKRouter, "qwen2_moe": Qwen2MoeTopKRouter,
                    "qwen3_moe": Qwen3MoeTopKRouter}[arch]  # fmt: skip
    hf_router = router_class(hf_config)
    torch.manual_seed(0)
    torch.nn.init.normal_(hf_router.weight, std=0.5)
    moe = ModelArchConfig.from_hf_config({**hf_config.to_dict(), **spec}).moe
    assert moe is not None
    x = torch.randn(50, 64)
    _, hf_weights, hf_ids = hf_router(x)
    weights, ids = route(torch.nn.functional.linear(x, hf_router.weight), moe.num_experts_per_tok,
                         moe.renormalize)  # fmt: skip
    hf_ids, order = hf_ids.sort(dim=-1)
    assert torch.equal(ids, hf_ids)
    hf_sorted = hf_weights.float().gather(-1, order)
    torch.testing.assert_close(weights, hf_sorted, atol=0 if top_k == 2 else 1e-7, rtol=0)
    assert torch.allclose(weights.sum(-1), torch.ones(50)) == moe.renormalize


def _block(arch: str, dtype: torch.dtype) -> SparseMoeBlock:
    """A layer's experts with random weights at `MOE_SHAPES`, set up as the loader sets a model
    (packing, duet's kernel where it is used, the row-invariance probe)."""
    spec = {**ARCH_CONFIGS[arch], **MOE_SHAPES, "vocab_size": 512, "intermediate_size": 512,
            "num_hidden_layers": 2}  # fmt: skip
    cfg = ModelArchConfig.from_hf_config(spec)
    torch.manual_seed(1)
    block = SparseMoeBlock(cfg, SINGLE, None)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    block = block.to(dtype)
    use_dense_kernel_pairs(block)
    pack_linears(block)
    use_dense_kernel(block)
    assert row_invariant.check_model(block, dtype).ok
    return block


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_tokens_output_does_not_depend_on_what_else_its_experts_received(dtype):
    """Qwen2-MoE's block (routed experts, the shared expert and its gate): every row of a batch
    of 160 equals the row alone, and inside other batches, bitwise."""
    block = _block("qwen2_moe", dtype)
    torch.manual_seed(2)
    x = torch.randn(160, MOE_SHAPES["hidden_size"]).to(dtype)
    with torch.no_grad():
        whole = block(x)
        alone = torch.cat([block(x[i : i + 1]) for i in range(len(x))])
        assert torch.equal(alone, whole)
        for rows in (slice(5, 21), slice(40, 137)):
            assert torch.equal(block(x[rows]), whole[rows]), rows
        # the same token among others routed elsewhere
        mixed = torch.cat([torch.randn(63, x.shape[1]).to(dtype), x[100:101]])
        assert torch.equal(block(mixed)[-1], whole[100])


def _llm(path: str, dtype: str, **kw) -> LLM:
    return LLM(path, dtype=dtype, load_progress=False, num_kv_blocks=64, deterministic=True, **kw)


@pytest.mark.parametrize(
    ("arch", "dtype"), [*((a, "bfloat16") for a in MOE_ARCHS), ("qwen2_moe", "float32")]
)
def test_alone_batched_chunked_and_prefix_hits_are_bitwise_equal(tiny_model_factory, arch, dtype):
    """Tokens and top-5 logprobs, bitwise: a 161-token prompt cold, again (a prefix hit whose
    last token runs the decode kernel), among 15 others, and prefilled in chunks of 7 in
    another engine; a prompt sharing 100 tokens with it after the hit (9 tokens run) and cold
    in chunks. fp32 for Qwen2-MoE only (its shared expert's gate), bf16 for each."""
    moe_model = tiny_model_factory(arch, **MOE_SHAPES)
    llm = _llm(moe_model, dtype, max_num_seqs=16)
    chunked = _llm(moe_model, dtype, max_num_batched_tokens=7)
    assert_alone_batched_chunked_and_hits_equal(llm, chunked)


def test_tensor_parallel_2_equals_1(tiny_model_factory):
    """TP=2 (a follower process over gloo): every expert's, the shared expert's and the dense
    layer's intermediate size split in two, the router whole, one all-reduce per layer; fp32
    greedy tokens equal TP=1's except at a near-tie (the all-reduce's order of summation)."""
    from tests.engine.test_aggregated_tp import _count_flips

    model = tiny_model_factory("qwen2_moe", **MOE_SHAPES)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    want = _llm(model, "float32").generate(_prompts(), params)
    tp = LLM(model, dtype="float32", load_progress=False, num_kv_blocks=64, tensor_parallel_size=2)
    block = tp.engine.runner.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    assert block.cpu_experts is not None  # the grouped CPU kernel, each expert's half
    assert block.cpu_experts.intermediate_size == MOE_SHAPES["moe_intermediate_size"] // 2
    assert _count_flips(want, tp.generate(_prompts(), params)) <= 1


def test_int8_experts_are_quantized_and_batch_invariant(tiny_model_factory):
    model = tiny_model_factory("qwen3_moe", **MOE_SHAPES)
    llm = _llm(model, "bfloat16", quantization="int8", max_num_seqs=16)
    names = [
        n
        for n, m in llm.engine.runner.model.named_modules()
        if type(m).__name__ == "QuantizedLinear"
    ]
    assert "layers.0.mlp.experts.15.gate_up_proj" in names
    assert not any(n.endswith("mlp.gate") for n in names)  # the router stays dense
    rng = random.Random(3)
    prompt = _prompt(rng, 100)
    alone = _result(llm.generate([prompt], PARAMS)[0])
    others = [_prompt(rng, rng.randrange(1, 60)) for _ in range(15)]
    assert _result(llm.generate([*others[:9], prompt, *others[9:]], PARAMS)[9]) == alone
