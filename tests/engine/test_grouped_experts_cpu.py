"""A sparse layer's experts as grouped products on duet's dense CPU kernel
(engine/kernels/grouped_linear_cpu.cpp, engine/model/grouped_experts_cpu.py): each group's rows
equal the plain kernel's product with its expert's weight bitwise, a token's output does not
depend on how many tokens its experts received, the counts that cut the rows are the expert
load's, and the loader puts dense experts on it (quantized ones: test_grouped_quant_experts.py)."""

from __future__ import annotations

import pytest
import torch

from duet.engine import LLM
from duet.engine.model import ModelArchConfig
from duet.engine.model.dense_cpu_linear import load_dense_kernel
from duet.engine.model.expert_load import record_expert_ids
from duet.engine.model.grouped_experts_cpu import CpuGroupedExperts
from duet.engine.model.grouped_quant_experts_cpu import CpuGroupedQuantExperts
from duet.engine.model.moe import SparseMoeBlock, route
from duet.engine.parallel import SINGLE
from tests.conftest import ARCH_CONFIGS
from tests.engine.test_moe import MOE_SHAPES

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def kernel():
    module = load_dense_kernel()
    assert module is not None, "the dense kernel did not build"
    return module


def _amx_pairs(kernel, dtype: torch.dtype, k: int) -> bool:
    """Whether `pack_dense` packs AMX column pairs here (which the grouped call does not take)."""
    return dtype == torch.bfloat16 and kernel.amx() and k % 32 == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_each_group_equals_the_plain_kernel_bitwise(kernel, dtype):
    """Five experts of [200, 136] (N off the tile, K off the lanes and off AMX's 32) with 0, 1,
    7, 150 (three row blocks) and 2 rows, the rows strided as silu_and_mul leaves them."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(200, 136, generator=g).to(dtype) for _ in range(5)]
    counts = [0, 1, 7, 150, 2]
    x = torch.randn(sum(counts), 2 * 136, generator=g).to(dtype)[:, :136]  # row stride 272
    panels = torch.stack([kernel.pack_dense(w) for w in weights])
    out = kernel.grouped_dense_linear(x, panels, counts, 200)
    assert out.shape == (160, 200) and out.dtype == dtype
    start = 0
    for w, count in zip(weights, counts, strict=True):
        rows = x[start : start + count]
        want = kernel.dense_linear_packed(rows.contiguous(), kernel.pack_dense(w), 200, None)
        assert torch.equal(out[start : start + count], want)
        torch.testing.assert_close(
            out[start : start + count].float(), rows.float() @ w.float().T,
            rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-4,
        )  # fmt: skip
        start += count
    with pytest.raises(RuntimeError, match="counts must add up to x's rows"):
        kernel.grouped_dense_linear(x, panels, [0, 1, 7, 150, 1], 200)


def _block(dtype: torch.dtype) -> SparseMoeBlock:
    """Qwen3-MoE's block (16 experts, top-2) at `MOE_SHAPES`, random weights, not grouped."""
    spec = {**ARCH_CONFIGS["qwen3_moe"], **MOE_SHAPES, "vocab_size": 512,
            "intermediate_size": 512, "num_hidden_layers": 2}  # fmt: skip
    torch.manual_seed(1)
    block = SparseMoeBlock(ModelArchConfig.from_hf_config(spec), SINGLE, None)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return block.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_a_tokens_output_does_not_depend_on_its_experts_other_tokens(kernel, dtype):
    block = _block(dtype)
    if _amx_pairs(kernel, dtype, MOE_SHAPES["hidden_size"]):
        assert not block.group_experts_cpu(kernel)  # the per-expert AMX tiles stay
        pytest.skip("bf16 experts keep the per-expert AMX tiles on this CPU")
    torch.manual_seed(2)
    x = torch.randn(160, MOE_SHAPES["hidden_size"]).to(dtype)
    with torch.no_grad():
        reference = block(x)  # per expert, the plain layers
        assert block.group_experts_cpu(kernel)
        assert isinstance(block.cpu_experts, CpuGroupedExperts) and len(block.experts) == 0
        whole = block(x)
        if dtype == torch.float32:
            torch.testing.assert_close(whole, reference, rtol=1e-5, atol=1e-5)
        alone = torch.cat([block(x[i : i + 1]) for i in range(len(x))])
        assert torch.equal(alone, whole)
        for rows in (slice(5, 21), slice(40, 137)):
            assert torch.equal(block(x[rows]), whole[rows]), rows
        # token 100 beside 40 copies of token 7: its experts get other counts (one of token
        # 7's experts 40 rows more, token 100's own ones maybe none besides it)
        crowd = torch.cat([x[7:8].expand(40, -1), x[100:101]])
        _, ids = route(block.gate(crowd), block.top_k, block.renormalize)
        counts = torch.bincount(ids.reshape(-1), minlength=block.num_experts)
        assert counts.max().item() >= 40
        assert torch.equal(block(crowd)[-1], whole[100])


def test_the_expert_load_is_the_count_that_cut_the_rows(kernel):
    block = _block(torch.float32)
    assert block.group_experts_cpu(kernel)
    block.expert_counts = torch.zeros(block.num_experts, dtype=torch.int64)
    want = torch.zeros(block.num_experts, dtype=torch.int64)
    torch.manual_seed(3)
    with torch.no_grad():
        for num_tokens in (1, 37, 160):
            x = torch.randn(num_tokens, MOE_SHAPES["hidden_size"])
            block(x)
            _, ids = route(block.gate(x), block.top_k, block.renormalize)
            record_expert_ids(want, ids)
    assert torch.equal(block.expert_counts, want)
    assert block.expert_counts.sum().item() == (1 + 37 + 160) * block.top_k


@pytest.mark.parametrize(
    ("dtype", "quantization", "kind", "kept"),
    [("float32", None, CpuGroupedExperts, 0), ("bfloat16", "int8", CpuGroupedQuantExperts, 16)],
)
def test_the_loader_groups_dense_and_quantized_experts(
    tiny_model_factory, dtype, quantization, kind, kept
):
    """Dense experts' per-expert layers are dropped; quantized ones stay over the stacks'
    buffers (test_grouped_quant_experts.py)."""
    llm = LLM(tiny_model_factory("qwen3_moe"), dtype=dtype, load_progress=False,
              num_kv_blocks=16, quantization=quantization)  # fmt: skip
    for i in (0, 1):
        block = llm.engine.runner.model.layers[i].mlp
        assert isinstance(block, SparseMoeBlock)
        assert isinstance(block.cpu_experts, kind) and len(block.experts) == kept


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_routers_that_fill_the_kernels_panels_take_it(tiny_model_factory, dtype):
    """A router whose expert count is whole panels of duet's kernel (64 experts: one panel of
    64 channels on AVX-512) takes the kernel, not oneDNN (a router's few outputs are all
    overhead there); one that is not (16 experts there) stays as it was. bf16 where the kernel
    packs column pairs (AMX, or AVX512-BF16's dot) puts every bf16 product on them in
    deterministic mode, routers of any count included."""
    kernel = load_dense_kernel()
    tile = kernel.pack_dense(torch.zeros(1, 16)).shape[-1]
    assert tile in (16, 32, 64)  # 4 column blocks of 4, 8 or 16 lanes
    pairs = dtype == "bfloat16" and (kernel.amx() or kernel.bf16_dot())
    for experts in (64, 16):
        model = tiny_model_factory("qwen3_moe", num_experts=experts)
        llm = LLM(model, dtype=dtype, load_progress=False, num_kv_blocks=16)
        for layer in llm.engine.runner.model.layers:
            on_kernel = getattr(layer.mlp.gate, "cpu_kernel", None) is not None
            assert on_kernel == (pairs or experts % tile == 0), (experts, tile)


@pytest.mark.parametrize(
    ("dtype", "scale_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
    ids=["fp32", "bf16-fp32-weights", "bf16-bf16-weights"],
)
def test_moe_combine_is_the_scatter_and_the_adds_bitwise(dtype, scale_dtype):
    """`moe_combine` (engine/kernels/elementwise_cpu.cpp) against moe_combine.combine_choices' torch
    steps: each row scaled and rounded, scattered to its slot, a token's choices added in order
    with a rounding per add; slots no row has (another expert-parallel rank's) add zero. 37
    columns: whole vectors and a scalar tail."""
    from duet.engine.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    assert kernels is not None
    g = torch.Generator().manual_seed(5)
    tokens, top_k, hidden = 9, 4, 37
    order = torch.randperm(tokens * top_k, generator=g)[:30]  # 6 slots are another rank's
    y = torch.randn(30, hidden, generator=g).to(dtype)
    scale = torch.rand(30, generator=g).to(scale_dtype)
    out = torch.zeros(tokens * top_k, hidden, dtype=dtype)
    out.index_copy_(0, order, (y * scale.view(-1, 1)).to(dtype))
    per_choice = out.view(tokens, top_k, hidden)
    want = per_choice[:, 0]
    for k in range(1, top_k):
        want = want + per_choice[:, k]
    got = kernels.moe_combine(y, order, scale, tokens, top_k)
    assert got.dtype == dtype and torch.equal(got, want)
    with pytest.raises(RuntimeError, match=r"order\[1\] = 3: must be a slot in \[0, 36\) no other"):
        kernels.moe_combine(y[:2], torch.tensor([3, 3]), scale[:2], tokens, top_k)
