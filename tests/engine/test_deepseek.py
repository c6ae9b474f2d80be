"""DeepSeek-V2/V3 (issue 44): multi-head latent attention over a paged cache of compressed
entries, and DeepSeek's routers, against HF transformers' own classes on the same random weights
(fp32: greedy tokens and top-5 logprobs; the routers bitwise); the cache's layout and size in
the runner, KV sizing and `duet plan`; what is refused; and batch invariance in bf16."""

from __future__ import annotations

import random

import pytest
import torch

from duet.engine import LLM, InvalidInputError, ModelLoadError, SamplingParams
from duet.engine.loader import load_model
from duet.engine.memory_plan import PlanSettings, plan_layouts
from duet.engine.model import ModelArchConfig
from duet.engine.model.deepseek_router import route_deepseek
from duet.engine.model.mla import MLAttention, check_mla_layout
from duet.engine.model.moe import SparseMoeBlock
from tests.conftest import ARCH_CONFIGS, DEEPSEEK_ARCHS
from tests.engine.test_batch_invariance import (
    PARAMS,
    _prompt,
    _result,
    assert_alone_batched_chunked_and_hits_equal,
)
from tests.engine.test_moe import MAX_TOKENS, NUM_PROMPTS, _prompts, hf_logprobs

DEEPSEEK_SHAPES = dict(hidden_size=128, initializer_range=0.05)
"""Wider than the tiny models' 64 (every projection a real product), still fast."""


def assert_same_tokens(got: list, want: list, atol: float = 1e-5) -> None:
    """Two engines' outputs for the same prompts: the same tokens, the same top logprob ids,
    and their logprobs within `atol`."""
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert [t.token_id for t in x.top] == [t.token_id for t in y.top]
            lx, ly = ([t.logprob for t in lp.top] for lp in (x, y))
            torch.testing.assert_close(torch.tensor(lx), torch.tensor(ly), atol=atol, rtol=0)


def _llm(path: str, dtype: str, **kw) -> LLM:
    return LLM(path, dtype=dtype, load_progress=False, num_kv_blocks=64, deterministic=True, **kw)


@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_greedy_tokens_and_top5_logprobs_match_hf(tiny_model_factory, arch):
    """HF scores duet's prompt + output in one forward pass: every output token is HF's argmax
    after the tokens before it, and each step's top 5 are HF's, their logprobs within 1e-4 (the
    tolerance of the other mixtures' test: duet attends in the absorbed form, HF expands K/V)."""
    model_dir = tiny_model_factory(arch, **DEEPSEEK_SHAPES)
    prompts = _prompts()
    assert len(prompts) == NUM_PROMPTS
    llm = LLM(model_dir, dtype="float32", load_progress=False, num_kv_blocks=64)
    model = llm.engine.runner.model
    assert model.config.mla is not None and model.kv_spec.is_latent
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    refs = hf_logprobs(model_dir, [p + o.token_ids for p, o in zip(prompts, outs, strict=True)])
    for prompt, sample, ref in zip(prompts, outs, refs, strict=True):
        steps = ref[len(prompt) - 1 : -1]  # [MAX_TOKENS, vocab]: what predicts each output
        assert sample.token_ids == steps.argmax(-1).tolist()
        for lp, step in zip(sample.logprobs, steps, strict=True):
            top = step.topk(5)
            assert [t.token_id for t in lp.top] == top.indices.tolist()
            got = torch.tensor([t.logprob for t in lp.top])
            torch.testing.assert_close(got, top.values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v2_grouped", "deepseek_v3"])
def test_router_matches_hf(arch):
    """Experts as HF's router chooses them (in expert order) and their weights: V2's greedy and
    group-limited softmax bitwise; V3's sigmoid noaux_tc with a correction bias within one ulp
    (duet's sigmoid takes torch's scalar path for every element, `row_invariant.elementwise`;
    HF's contiguous one vectorised code, which differs in the last bit: 1 weight in 400 here)."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    spec = {**ARCH_CONFIGS[arch], "hidden_size": 64, "num_attention_heads": 4}
    model_type = spec.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **spec)
    v3 = model_type == "deepseek_v3"
    hf_router = (DeepseekV3TopkRouter if v3 else DeepseekV2TopkRouter)(hf_config)
    torch.manual_seed(0)
    torch.nn.init.normal_(hf_router.weight, std=0.5)
    bias = None
    if v3:
        hf_router.e_score_correction_bias.normal_(0.0, 0.2)  # a buffer (no grad)
        bias = hf_router.e_score_correction_bias
    moe = ModelArchConfig.from_hf_config({**hf_config.to_dict(), **spec}).moe
    assert moe is not None
    x = torch.randn(200, 64)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_router(x)
        weights, ids = route_deepseek(torch.nn.functional.linear(x, hf_router.weight), moe, bias)
    hf_ids, order = hf_ids.sort(dim=-1)
    assert torch.equal(ids, hf_ids)
    rtol = 2.4e-7 if v3 else 0.0
    torch.testing.assert_close(weights, hf_weights.gather(-1, order), atol=0, rtol=rtol)


def test_cache_holds_one_latent_entry_per_token_and_layer(tiny_model_factory):
    """The runner's cache, KV sizing and `duet plan` agree on the latent layout: one plane of
    kv_lora_rank + qk_rope_head_dim values per token and layer, on every TP rank, and the plan's
    weight bytes are the loaded model's (kv_b_proj counted once: split at load into the absorbed
    products)."""
    model_dir = tiny_model_factory("deepseek_v3", **DEEPSEEK_SHAPES)
    llm = LLM(model_dir, dtype="float32", load_progress=False, num_kv_blocks=64, block_size=16)
    engine = llm.engine
    model = engine.runner.model
    entry = 48 + 16  # kv_lora_rank + qk_rope_head_dim
    assert [tuple(c.shape) for c in engine.runner.kv_caches] == [(1, 64, 16, 1, entry)] * 3
    assert model.kv_spec.bytes_per_block(3, 16, torch.float32) == 3 * 16 * entry * 4
    attn = model.layers[0].self_attn
    assert isinstance(attn, MLAttention) and attn.kv_b_proj is None
    # the 4 heads' absorbed products as two grouped calls on duet's CPU kernel (panels)
    assert attn.grouped_kernel is not None and len(attn.k_absorb) == len(attn.v_absorb) == 0
    assert attn.k_panels is not None and attn.v_panels is not None
    assert attn.k_panels.shape[0] == attn.v_panels.shape[0] == 4
    assert isinstance(model.layers[1].mlp, SparseMoeBlock)
    assert not isinstance(model.layers[0].mlp, SparseMoeBlock)  # first_k_dense_replace
    # V3 checkpoints' multi-token-prediction layer (index num_hidden_layers) is not loaded
    assert model.placement.skips("model.layers.3.self_attn.kv_a_proj_with_mqa.weight")
    assert not model.placement.skips("model.layers.2.self_attn.kv_a_proj_with_mqa.weight")
    settings = PlanSettings(dtype=torch.float32, block_size=16, cuda_graphs=False)
    plans = plan_layouts(engine.arch, 4, 8 << 30, settings)
    assert [(p.tp, p.pp) for p in plans] == [(1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (2, 2),
                                             (4, 1)]  # fmt: skip
    plan = plans[0]
    # every rank caches the whole entry of its stage's layers (heads sharded, the latent not)
    for p in plans:
        for r in p.ranks:
            assert r.kv_block_bytes == (r.layers[1] - r.layers[0]) * 16 * entry * 4
    cpu = torch.device("cpu")
    loaded = load_model(model_dir, torch.float32, cpu, progress=False, deterministic=False)
    # the grouped panels pad each head's absorbed product to the kernel's whole column tiles
    # (the tiny model's 48 and 24 columns; none at DeepSeek's 512 and 128)
    absorbed = 4 * (48 * 16 + 24 * 48)  # 4 heads' W_UK^T [latent, nope] and W_UV [v, latent]
    padding = sum(
        layer.self_attn.k_panels.numel() + layer.self_attn.v_panels.numel() - absorbed
        for layer in loaded.model.layers
    )
    assert plan.ranks[0].weights_bytes + 4 * padding == loaded.weight_bytes


@pytest.mark.parametrize(
    "widths", [{}, {"kv_lora_rank": 512, "qk_rope_head_dim": 64}], ids=["entry64", "entry576"]
)
def test_kernel_and_reference_attention_agree(tiny_model_factory, widths):
    """The runner takes the C++ kernels for the latent cache by default on the CPU (the
    entry read as one KV head, at the tiny models' 64 values and DeepSeek's 576) and the
    torch reference when asked: the same greedy tokens in fp32, top-2 logprobs within 1e-5.
    An entry of 48 values has no kernel and takes the reference."""
    model_dir = tiny_model_factory("deepseek_v3", **DEEPSEEK_SHAPES, **widths)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    kernel = _llm(model_dir, "float32")
    assert kernel.engine.runner.attention_backend == "cpu"
    reference = _llm(model_dir, "float32", attention_backend="torch")
    assert reference.engine.runner.attention_backend == "torch"
    assert_same_tokens(kernel.generate(_prompts(), params), reference.generate(_prompts(), params))
    narrow = tiny_model_factory("deepseek_v3", **{**DEEPSEEK_SHAPES, "kv_lora_rank": 32})
    assert _llm(narrow, "float32").engine.runner.attention_backend == "torch"


def test_tensor_parallelism_with_attention_bias_is_refused():
    spec = {**ARCH_CONFIGS["deepseek_v3"], "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "attention_bias": True}  # fmt: skip
    arch = ModelArchConfig.from_hf_config(spec)
    check_mla_layout(arch, 1)
    with pytest.raises(InvalidInputError, match="attention_bias") as err:
        check_mla_layout(arch, 2)
    assert err.value.field == "tensor_parallel_size"


def test_tensor_parallel_2_equals_1(tiny_model_factory):
    """TP=2 (a follower process over gloo): each rank holds 2 of the 4 heads (their rows of
    q_b_proj and kv_b_proj, their columns of o_proj), the latent whole, and caches the same
    entries; every expert's and the dense layer's intermediate size halved. fp32 greedy tokens
    equal TP=1's except at a near-tie (the all-reduce's order of summation)."""
    from tests.engine.test_aggregated_tp import _count_flips

    model_dir = tiny_model_factory("deepseek_v3", **DEEPSEEK_SHAPES)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    want = _llm(model_dir, "float32").generate(_prompts(), params)
    tp = LLM(
        model_dir, dtype="float32", load_progress=False, num_kv_blocks=64, tensor_parallel_size=2
    )
    model = tp.engine.runner.model
    attn = model.layers[0].self_attn
    assert isinstance(attn, MLAttention) and attn.num_heads == 2
    assert model.kv_spec.shape(64, 16) == (1, 64, 16, 1, 64)  # the whole entry on every rank
    assert _count_flips(want, tp.generate(_prompts(), params)) <= 1


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
         "rope_scaling type 'linear' is not supported"),
        ({"moe_layer_freq": 2}, "moe_layer_freq 2 is not supported"),
        ({"norm_topk_prob": True}, "norm_topk_prob true is not supported"),
        ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
        ({"quantization_config": {"quant_method": "fp8"}}, "fp8-quantized checkpoint"),
    ],
)  # fmt: skip
def test_unsupported_configs_are_refused(override, message):
    spec = {**ARCH_CONFIGS["deepseek_v2"], "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, **override}  # fmt: skip
    with pytest.raises(ModelLoadError, match=message):
        ModelArchConfig.from_hf_config(spec)


@pytest.mark.parametrize("arch", ["deepseek_v2_grouped", "deepseek_v3"])
def test_alone_batched_chunked_and_prefix_hits_are_bitwise_equal_in_bf16(tiny_model_factory, arch):
    """Tokens and top-5 logprobs, bitwise, in bf16: a 161-token prompt cold, again (a prefix
    hit: its last token runs as a decode), among 15 others, and prefilled in chunks of 7 in
    another engine; a prompt sharing 100 tokens with it after the hit and cold in chunks."""
    model_dir = tiny_model_factory(arch, **DEEPSEEK_SHAPES)
    llm = _llm(model_dir, "bfloat16", max_num_seqs=16)
    chunked = _llm(model_dir, "bfloat16", max_num_batched_tokens=7)
    assert_alone_batched_chunked_and_hits_equal(llm, chunked)


def test_yarn_scales_the_softmax_and_the_rotary_tables():
    """V3 under yarn: the softmax scale times mscale(factor, mscale_all_dim)^2, cos and sin
    times HF's attention factor (mscale(factor, mscale) / mscale(factor, mscale_all_dim))."""
    from duet.engine.model.arch import yarn_mscale

    spec = {**ARCH_CONFIGS["deepseek_v3_yarn"], "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4}  # fmt: skip
    mla = ModelArchConfig.from_hf_config(spec).mla
    assert mla is not None
    assert mla.softmax_scale == pytest.approx(32**-0.5 * yarn_mscale(4.0, 0.7) ** 2)
    assert mla.rope_attention_factor == pytest.approx(yarn_mscale(4.0, 1.0) / yarn_mscale(4.0, 0.7))


def test_expert_parallel_2_gives_tp1_tokens(tiny_model_factory):
    """EP=2 with TP=2 (heads sharded, each rank half the 16 routed experts whole, the router and
    its correction bias whole, the shared expert sliced): V3's fp32 greedy tokens equal TP=1's
    (at most one near-tie flip)."""
    from tests.engine.test_aggregated_tp import _count_flips

    model_dir = tiny_model_factory("deepseek_v3", **DEEPSEEK_SHAPES)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    want = _llm(model_dir, "float32").generate(_prompts(), params)
    ep = LLM(model_dir, dtype="float32", load_progress=False, num_kv_blocks=64,
             tensor_parallel_size=2, expert_parallel_size=2)  # fmt: skip
    block = ep.engine.runner.model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock) and block.first_expert == 0
    # this rank's 8 experts, grouped on the CPU kernel (their per-expert layers dropped)
    assert block.cpu_experts is not None and block.cpu_experts.num_experts == 8
    assert _count_flips(want, ep.generate(_prompts(), params)) <= 1


def test_pipeline_parallel_2_equals_1(tiny_model_factory):
    """PP=2 (a follower process): stage 0 runs the dense layer 0 and sparse layer 1, stage 1
    layer 2, each caching its own layers' entries; the prompts' steps run as micro-batches.
    fp32 greedy tokens identical (a stage computes what one rank would)."""
    from tests.engine.test_pipeline_parallel import _prompts as pp_prompts
    from tests.engine.test_pipeline_parallel import _tokens

    model_dir = tiny_model_factory("deepseek_v3", **DEEPSEEK_SHAPES)
    prompts = pp_prompts(512, 8)
    assert _tokens(model_dir, prompts, pipeline_parallel_size=2) == _tokens(model_dir, prompts)


def test_int8_projections_are_quantized_and_batch_invariant(tiny_model_factory):
    """`quantization="int8"`: the attention's projections and the experts are `QuantizedLinear`s,
    the absorbed halves of kv_b_proj and the router stay dense; bf16, a prompt alone equals the
    same prompt among 15 others, bitwise."""
    model_dir = tiny_model_factory("deepseek_v3", **DEEPSEEK_SHAPES)
    llm = _llm(model_dir, "bfloat16", quantization="int8", max_num_seqs=16)
    quantized = {
        n
        for n, m in llm.engine.runner.model.named_modules()
        if type(m).__name__ == "QuantizedLinear"
    }
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
        assert f"layers.0.self_attn.{name}" in quantized
    assert "layers.1.mlp.experts.0.gate_up_proj" in quantized
    assert not any("absorb" in n or n.endswith("mlp.gate") for n in quantized)
    rng = random.Random(3)
    prompt = _prompt(rng, 100)
    alone = _result(llm.generate([prompt], PARAMS)[0])
    others = [_prompt(rng, rng.randrange(1, 60)) for _ in range(15)]
    assert _result(llm.generate([*others[:9], prompt, *others[9:]], PARAMS)[9]) == alone
