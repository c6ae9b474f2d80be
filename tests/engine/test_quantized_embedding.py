"""A tied embedding read from its quantized LM head (engine/model/quantized_embedding.py): the
rows equal the dequantized head's, bit for bit, in every layout (the CPU kernels' through their
row kernels), and a tied model with a quantized head keeps one table."""

from __future__ import annotations

import pytest
import torch

from duet.engine.loader import load_model
from duet.engine.model import quantized_linear
from duet.engine.model.quantized_embedding import can_gather_rows, gather_rows
from duet.engine.model.quantized_linear import QuantizedLinear, quantize_linear
from duet.engine.model.weight_bytes import weight_bytes
from duet.engine.quant.config import QuantizationConfig
from duet.engine.quant.cpu_linear import load_quant_kernels, pack_int4, unpack_int4
from duet.engine.quant.formats import quantize_int4, quantize_int8
from tests.conftest import SMOLLM2_SHAPES

CPU = torch.device("cpu")
K = 576
N = 200  # 12 full blocks of 16 channels and a padded one
CONFIGS = [
    QuantizationConfig("int8"),
    QuantizationConfig("int4", 32, symmetric=False),
    QuantizationConfig("int4", 64, symmetric=True),
]
IDS = ["int8", "int4-g32-asym", "int4-g64-sym"]
TOKENS = torch.tensor([0, 1, 7, 8, 15, 16, 17, 31, 100, 199, 7, 0])  # every lane half, repeats


def head(config: QuantizationConfig, dtype: torch.dtype, layout: str) -> QuantizedLinear:
    weight = torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05
    if layout == "torch":  # where duet's kernels cannot be built
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(quantized_linear, "load_quant_kernels", lambda: None)
            return quantize_linear(weight, None, config, dtype)
    if layout == "triton":  # the CUDA layout (rows of nibbles or int8), built on the CPU
        layer = QuantizedLinear(K, N, False, config)
        if config.method == "int8":
            rounded = quantize_int8(weight)
        else:
            rounded = quantize_int4(weight, config.group_size, config.symmetric)
        layer.set_weight(rounded, dtype, CPU, triton=True)
        return layer
    layer = quantize_linear(weight, None, config, dtype)
    return layer


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["duet", "triton", "torch"])
def test_rows_are_the_dequantized_heads_rows(config, dtype, layout: str) -> None:
    layer = head(config, dtype, layout)
    if not can_gather_rows(layer):
        assert layout == "torch" and config.method == "int4"  # torch's opaque int4 packing
        with pytest.raises(ValueError, match="cannot give single rows"):
            gather_rows(layer, TOKENS, dtype)
        return
    rows = gather_rows(layer, TOKENS, dtype)
    assert rows.shape == (len(TOKENS), K) and rows.dtype == dtype
    assert torch.equal(rows, layer.dequantize(dtype)[TOKENS])


def test_a_tied_model_with_a_quantized_head_keeps_one_table(tiny_model_factory) -> None:
    path = tiny_model_factory("llama", tie_word_embeddings=True, **SMOLLM2_SHAPES)
    config = QuantizationConfig("int4", 32, lm_head=True)
    dense_head = load_model(path, torch.bfloat16, CPU, progress=False, deterministic=False,
                            quantization=QuantizationConfig("int4", 32)).model  # fmt: skip
    quantized = load_model(path, torch.bfloat16, CPU, progress=False, deterministic=False,
                           quantization=config).model  # fmt: skip
    assert not dense_head.embedding_in_head and quantized.embedding_in_head
    table = dense_head.embed_tokens.weight
    assert quantized.embed_tokens.weight.shape == (0, table.shape[1])
    assert isinstance(quantized.tied_head, QuantizedLinear)
    # the table's bf16 bytes are gone (and the dense head's packed copy of it, if any): the
    # quantized head stands for both
    head_copy = sum(t.nbytes for t in [*dense_head.tied_head.parameters(),
                                       *dense_head.tied_head.buffers()])  # fmt: skip
    saved = weight_bytes(dense_head)[0] - weight_bytes(quantized)[0]
    assert saved == table.numel() * 2 + head_copy - quantized.tied_head.weight_bytes()
    ids = torch.tensor([3, 1, 4, 1, 5, 511])
    expected = quantized.tied_head.dequantize(torch.bfloat16)[ids]
    assert torch.equal(quantized._embed(ids), expected)


@pytest.mark.parametrize("pairs", [True, False], ids=["pairs", "columns"])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-out", "bf16-out"])
def test_the_int4_row_kernel_takes_both_layouts_and_a_gguf_files_fp32_scales(
    pairs: bool, scale_dtype: torch.dtype, dtype: torch.dtype
) -> None:
    """`int4_rows` (the kernel `gather_rows` calls) in the layouts and scale dtypes a head can
    have (fp32: GGUF's exact values, kept by the repack): q x scale rounded, plus the offset
    rounded, then the dtype, as torch computes it; and an id past the table is refused."""
    kernels = load_quant_kernels()
    if kernels is None:
        pytest.fail("the quantized CPU kernels did not build")
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    scale, offset = torch.rand(N, K // 32, generator=gen), torch.randn(N, K // 32, generator=gen)
    nibbles, sz = pack_int4(q, scale, offset, pairs, scale_dtype)
    _, s, o = unpack_int4(nibbles, sz, N, pairs)
    want = (q.float().view(N, -1, 32) * s[..., None] + o[..., None]).view(N, K)[TOKENS].to(dtype)
    out = torch.empty(len(TOKENS), K, dtype=dtype)
    kernels.int4_rows(nibbles, sz, TOKENS, out, pairs)
    assert torch.equal(out, want)
    with pytest.raises(RuntimeError, match=r"ids\[0\] = 208 out of range \[0, 208\)"):
        kernels.int4_rows(nibbles, sz, torch.tensor([208]), out[:1], pairs)
