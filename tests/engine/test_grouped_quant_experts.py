"""A sparse layer's int8 and int4 experts as grouped products on duet's quantized CPU kernels
(engine/kernels/quant_linear_cpu.cpp: grouped_int8_linear / grouped_int4_linear,
engine/model/grouped_quant_experts_cpu.py): each expert's rows equal its own kernel call
bitwise, in every layout the kernels take; a block's output equals the per-expert loop's
bitwise, including experts past `kernel_max_rows` (their own layers). The loader's grouping:
test_grouped_experts_cpu.py."""

from __future__ import annotations

import pytest
import torch

from duet.engine.model import ModelArchConfig
from duet.engine.model.grouped_quant_experts_cpu import CpuGroupedQuantExperts
from duet.engine.model.moe import SparseMoeBlock, route
from duet.engine.model.quantized_linear import quantize_linear
from duet.engine.parallel import SINGLE
from duet.engine.quant.config import QuantizationConfig
from duet.engine.quant.cpu_linear import load_quant_kernels, pack_int4, pack_int8
from tests.conftest import ARCH_CONFIGS
from tests.engine.test_moe import MOE_SHAPES

COUNTS = [0, 1, 7, 40, 2]  # an idle expert, one row, a partial tile, several tiles, two
N, K, G = 168, 256, 32  # N off the 16-channel blocks; 11 blocks: off 4- and 6-block tiles


@pytest.fixture(scope="module")
def kernels():
    module = load_quant_kernels()
    assert module is not None, "the quantized CPU kernels did not build"
    return module


def _layouts(kernels) -> list[tuple[torch.dtype, bool]]:
    """(activation dtype, pairs) the kernels take here: fp32 FMAs for both dtypes, and the bf16
    dot's column pairs on an AVX512-BF16 build."""
    out = [(torch.float32, False), (torch.bfloat16, False)]
    return out + ([(torch.bfloat16, True)] if kernels.bf16_dot() else [])


def _rows(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(sum(COUNTS), 2 * K, generator=g).to(dtype)[:, :K]  # rows 2 K apart


def _check_groups(out: torch.Tensor, x: torch.Tensor, single) -> None:
    start = 0
    for e, count in enumerate(COUNTS):
        rows = x[start : start + count]
        if count:
            assert torch.equal(out[start : start + count], single(e, rows.contiguous())), e
        start += count


@pytest.mark.parametrize("layout", range(3), ids=["fp32", "bf16-fma", "bf16-pairs"])
def test_grouped_int8_equals_each_experts_own_call(kernels, layout):
    if layout >= len(_layouts(kernels)):
        pytest.skip("no AVX512-BF16 on this CPU: no column pairs")
    dtype, pairs = _layouts(kernels)[layout]
    g = torch.Generator().manual_seed(1)
    ops = [pack_int8(torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8),
                     torch.rand(N, K // G, generator=g) / 64, pairs) for _ in COUNTS]  # fmt: skip
    q, scale = torch.stack([o[0] for o in ops]), torch.stack([o[1] for o in ops])
    x = _rows(dtype)
    out = kernels.grouped_int8_linear(x, q, scale, COUNTS, N, 1, 1 << 40)
    assert out.shape == (sum(COUNTS), N) and out.dtype == dtype
    _check_groups(out, x, lambda e, rows: kernels.int8_linear(rows, *ops[e], N, 1))
    with pytest.raises(RuntimeError, match="counts must sum to x's rows"):
        kernels.grouped_int8_linear(x, q, scale, [0, 1, 7, 40, 1], N, 1, 1 << 40)
    with pytest.raises(RuntimeError, match="an expert per count"):
        kernels.grouped_int8_linear(x, q, scale, [0, 1, 7, 42], N, 1, 1 << 40)


@pytest.mark.parametrize("layout", range(4), ids=["fp32", "fp32-scales", "bf16-fma", "bf16-pairs"])
def test_grouped_int4_equals_each_experts_own_call(kernels, layout):
    cases = [(torch.float32, False, torch.bfloat16), (torch.float32, False, torch.float32),
             (torch.bfloat16, False, torch.bfloat16)]  # fmt: skip
    cases += [(torch.bfloat16, True, torch.bfloat16)] if kernels.bf16_dot() else []
    if layout >= len(cases):
        pytest.skip("no AVX512-BF16 on this CPU: no column pairs")
    dtype, pairs, scale_dtype = cases[layout]
    g = torch.Generator().manual_seed(2)
    ops = [pack_int4(torch.randint(0, 16, (N, K), generator=g), torch.rand(N, K // G, generator=g) / 8,
                     torch.randn(N, K // G, generator=g) / 8, pairs, scale_dtype)
           for _ in COUNTS]  # fmt: skip
    q4, sz = torch.stack([o[0] for o in ops]), torch.stack([o[1] for o in ops])
    x = _rows(dtype)
    out = kernels.grouped_int4_linear(x, q4, sz, COUNTS, N, pairs, 1, 1 << 40)
    _check_groups(out, x, lambda e, rows: kernels.int4_linear(rows, *ops[e], N, pairs, 1))


def _block(dtype: torch.dtype, method: str) -> SparseMoeBlock:
    """Qwen3-MoE's block (16 experts, top-2) at `MOE_SHAPES`, random weights, its experts
    quantized (rounded to nearest) for `dtype` activations, not grouped."""
    spec = {**ARCH_CONFIGS["qwen3_moe"], **MOE_SHAPES, "vocab_size": 512,
            "intermediate_size": 512, "num_hidden_layers": 2}  # fmt: skip
    config = QuantizationConfig(method=method)
    torch.manual_seed(1)
    block = SparseMoeBlock(ModelArchConfig.from_hf_config(spec), SINGLE, None)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    block.to(dtype)
    for expert in block.experts:
        for name in ("gate_up_proj", "down_proj"):
            dense = getattr(expert, name)
            setattr(expert, name, quantize_linear(dense.weight.float(), None, config, dtype))
    return block


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_grouped_block_equals_the_per_expert_loop(dtype, method):
    block = _block(dtype, method)
    torch.manual_seed(2)
    x = torch.randn(160, MOE_SHAPES["hidden_size"]).to(dtype)
    with torch.no_grad():
        loop = block(x)  # per expert, the QuantizedLinears
        assert block.group_experts_cpu(None)
        grouped = block.cpu_experts
        assert isinstance(grouped, CpuGroupedQuantExperts) and len(block.experts) == 16
        assert torch.equal(block(x), loop)
        for rows in (slice(0, 1), slice(5, 21)):
            assert torch.equal(block(x[rows]), loop[rows]), rows
        # experts past their layers' kernel rows take their own layers (which dequantize):
        # here some of the 16 (about 20 rows each), the rest grouped
        _, ids = route(block.gate(x), block.top_k, block.renormalize)
        counts = torch.bincount(ids.reshape(-1), minlength=16)
        assert (counts > 20).any() and (counts <= 20).any()
        for expert in block.experts:
            for layer in (expert.gate_up_proj, expert.down_proj):
                layer.kernel_max_rows, layer.min_rows = 20, 1
        block.cpu_experts = None
        loop = block(x)
        block.cpu_experts = grouped
        assert torch.equal(block(x), loop)


def test_grouping_shares_the_experts_buffers():
    block = _block(torch.bfloat16, "int8")
    before = [e.down_proj.q.clone() for e in block.experts]
    assert block.group_experts_cpu(None)
    stack = block.cpu_experts.w2_q
    for e, expert in enumerate(block.experts):
        assert expert.down_proj.q.data_ptr() == stack[e].data_ptr()
        assert torch.equal(expert.down_proj.q, before[e])
