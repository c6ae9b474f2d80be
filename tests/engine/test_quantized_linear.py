"""engine/model/quantized_linear.py and engine/quant/formats.py: int8 and int4 weight-only
linears against their dequantized reference, row by row, and their storage."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from duet.engine.config import EngineConfig
from duet.engine.errors import InvalidInputError, ModelLoadError
from duet.engine.model import quantized_linear
from duet.engine.model.concat_linear import ConcatLinear
from duet.engine.model.quantized_linear import QuantizedLinear, quantize_linear
from duet.engine.model.row_invariant import MIN_ROWS, Linear, linear_rows, probe
from duet.engine.quant.config import QuantizationConfig
from duet.engine.quant.formats import (
    Int4Weight,
    Int8Weight,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)

K = 576  # SmolLM2's hidden size (a multiple of 32 and 64, not of 128)
CONFIGS = [
    QuantizationConfig("int8"),
    QuantizationConfig("int4", 32, symmetric=False),
    QuantizationConfig("int4", 64, symmetric=True),
    QuantizationConfig("int4", 32, symmetric=True),
]
IDS = ["int8", "int4-g32-asym", "int4-g64-sym", "int4-g32-sym"]


def layer(config: QuantizationConfig, dtype: torch.dtype, n: int = 192, bias: bool = False):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, K, generator=gen) * 0.05
    b = torch.randn(n, generator=gen) if bias else None
    return quantize_linear(weight, b, config, dtype), weight


@pytest.fixture(params=["duet", "torch"])
def backend(request, monkeypatch) -> str:
    """duet's kernels (engine/quant/cpu_linear.py), or torch's where they cannot be built."""
    if request.param == "torch":
        monkeypatch.setattr(quantized_linear, "load_quant_kernels", lambda: None)
    return request.param


def duet_serves(config: QuantizationConfig, backend: str) -> bool:
    """Whether duet's kernels serve a CPU layer of `config` here: int8 and int4 on any build
    (fp32 FMAs, or the bf16 dot on AVX512-BF16), unless they cannot be built."""
    del config  # every format
    return backend == "duet" and quantized_linear.load_quant_kernels() is not None


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("kernel_max_rows", [1 << 62, 16], ids=["kernel", "dequantize-above-16"])
def test_bf16_equals_dequantized_reference(
    config: QuantizationConfig, kernel_max_rows: int, backend: str
) -> None:
    linear, _ = layer(config, torch.bfloat16, bias=True)
    assert linear.use_kernel is (config.method == "int4" or config.method == "int8")
    assert (linear.duet_kernels is not None) is duet_serves(config, backend)
    linear.kernel_max_rows = kernel_max_rows
    reference = linear.dequantize(torch.float32)  # [N, K]
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 7, 64, 2048):
        x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
        out = linear(x)
        assert out.shape == (rows, 192) and out.dtype == torch.bfloat16
        expected = F.linear(x.float(), reference, linear.bias.float())
        # bf16 output: a few units in the last place of the largest value
        torch.testing.assert_close(out.float(), expected, rtol=0, atol=expected.abs().max() / 64)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_fp32_is_the_dense_product_of_the_dequantized_weight(
    config: QuantizationConfig, backend: str
) -> None:
    linear, _ = layer(config, torch.float32)
    # duet's kernels; without them dequantize (torch's int4 kernel is scalar in fp32)
    assert linear.use_kernel is duet_serves(config, backend)
    linear.min_rows = 1
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 7, 64, 2048):
        x = torch.randn(rows, K, generator=gen)
        expected = F.linear(x, linear.dequantize(torch.float32))
        if linear.use_kernel:  # fp32 sums in another order: a few ulps
            torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(linear(x), expected)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_amx_layers_take_the_tiles_from_amx_min_rows(config: QuantizationConfig) -> None:
    """On an AMX CPU a bf16 layer's pairs go through the tiles: outside deterministic mode from
    `AMX_MIN_ROWS` rows (the bf16 dot below, faster at one row), in it from one row; either
    way within a bf16 rounding of the dequantized reference."""
    kernels = quantized_linear.load_quant_kernels()
    assert kernels is not None
    linear, _ = layer(config, torch.bfloat16)
    assert linear.amx is bool(kernels.amx() and kernels.bf16_dot())
    if not linear.amx:
        pytest.skip("this CPU has no AMX")
    assert linear.kernel_max_rows == quantized_linear.UNLIMITED  # tiles beat dequantizing
    assert linear.amx_min_rows == quantized_linear.AMX_MIN_ROWS
    reference = linear.dequantize(torch.float32)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    fast = torch.cat([linear(x[:1]), linear(x[1:3]), linear(x[3:])])
    quantized_linear.set_kernel_max_rows(linear, None)
    assert linear.amx_min_rows == 1
    tiles = linear(x)
    assert torch.equal(tiles[3:], fast[3:])  # 37 rows took the tiles both times
    assert torch.equal(torch.cat([linear(x[:1]), linear(x[1:3])]), tiles[:3])
    expected = F.linear(x.float(), reference)
    for out in (fast, tiles):
        torch.testing.assert_close(out.float(), expected, rtol=0, atol=expected.abs().max() / 64)
    quantized_linear.set_kernel_max_rows(linear, 16)
    assert (linear.kernel_max_rows, linear.amx_min_rows) == (16, quantized_linear.AMX_MIN_ROWS)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_kernel_rows_do_not_depend_on_the_batch(config: QuantizationConfig, backend: str) -> None:
    linear, _ = layer(config, torch.bfloat16)
    quantized_linear.set_kernel_max_rows(linear, None)  # deterministic mode's one product
    linear.min_rows = 1
    assert probe(linear, K, torch.bfloat16)  # rows 1..600, each alone and in every batch
    x = torch.randn(64, K).to(torch.bfloat16)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(64)])
    assert torch.equal(linear(x), alone)
    assert torch.equal(linear(x[:7]), alone[:7])


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_round_to_nearest_error_is_at_most_half_a_step(config: QuantizationConfig) -> None:
    _, weight = layer(config, torch.float32)
    if config.method == "int8":
        q = quantize_int8(weight)
        step = q.scale.expand(-1, K)
    else:
        q = quantize_int4(weight, config.group_size, config.symmetric)
        step = q.scale.repeat_interleave(config.group_size, dim=1)
    error = (q.dequantize() - weight).abs()
    assert bool((error <= step / 2 * (1 + 1e-5)).all())
    assert q.dequantize().shape == weight.shape


def test_kernel_layout_equals_torch_pack_and_unpacks() -> None:
    q = torch.randint(0, 16, (128, 96), generator=torch.Generator().manual_seed(0))
    packed = pack_int4(q)
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1))
    assert torch.equal(unpack_int4(packed), q.to(torch.uint8))


def test_rows_off_the_kernel_block_are_padded(backend: str) -> None:
    config = QuantizationConfig("int4", 32)
    linear, _ = layer(config, torch.bfloat16, n=88)
    if not duet_serves(config, backend):  # torch's kernel: blocks of 64 rows
        assert linear.packed.shape == (128, K // 2)
    else:  # blocks of 16 rows, column pairs
        assert linear.packed.shape == (6, K // 2, 16)
    x = torch.randn(3, K).to(torch.bfloat16)
    out = linear(x)
    assert out.shape == (3, 88)
    expected = F.linear(x.float(), linear.dequantize(torch.float32))
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=expected.abs().max() / 64)


def test_storage_bytes() -> None:
    n = 192
    int8, _ = layer(QuantizationConfig("int8"), torch.bfloat16, n=n)
    assert int8.weight_bytes() == n * K + n * 4  # int8 + an fp32 scale per row
    int4, _ = layer(QuantizationConfig("int4", 32), torch.bfloat16, n=n)
    assert int4.weight_bytes() == n * K // 2 + n * (K // 32) * 2 * 2  # nibbles + bf16 scale, zero
    assert int4.weight_bytes() / (n * K * 2) == pytest.approx(0.3125)
    int4_64, _ = layer(QuantizationConfig("int4", 64), torch.bfloat16, n=n)
    assert int4_64.weight_bytes() / (n * K * 2) == pytest.approx(0.28125)


def test_group_size_falls_back_to_one_that_divides_the_input() -> None:
    linear, _ = layer(QuantizationConfig("int4", 128), torch.bfloat16)
    assert linear.group_size == 64  # 576 = 4.5 x 128


def test_mixed_parts_keep_their_formats() -> None:
    config = QuantizationConfig("gguf")
    slot = QuantizedLinear(K, 96, True, config)
    assert slot.bias is not None
    with torch.no_grad():
        slot.bias.copy_(torch.randn(96))
    dense = torch.randn(32, K)
    q4 = quantize_int4(torch.randn(64, K), 32, symmetric=False)
    slot.load_part(0, q4)
    slot.load_part(64, dense)
    result = slot.finalize(torch.float32, torch.device("cpu"))
    # the int4 rows stay int4; the dense rows become a batch-invariant dense layer, which the
    # load-time probe sees (it has `min_rows`)
    assert isinstance(result, ConcatLinear)
    quantized, rest = result.layers
    assert isinstance(quantized, QuantizedLinear) and quantized.kind == "int4"
    assert isinstance(rest, Linear) and rest.min_rows == MIN_ROWS
    assert torch.equal(quantized.dequantize(torch.float32), q4.dequantize())
    assert torch.equal(rest.weight, dense)
    assert quantized.bias is not None and rest.bias is not None
    assert torch.equal(torch.cat([quantized.bias, rest.bias]), slot.bias)
    x = torch.randn(3, K)
    expected = F.linear(x, torch.cat([q4.dequantize(), dense]), slot.bias)
    torch.testing.assert_close(result(x), expected, rtol=1e-5, atol=1e-4)


def test_narrowing_off_a_group_is_refused() -> None:
    q4 = quantize_int4(torch.randn(64, K), 32, symmetric=True)
    assert isinstance(q4.narrow(1, 288, 288), Int4Weight)
    with pytest.raises(ModelLoadError, match=r"^tensor_parallel_size: a shard of columns"):
        q4.narrow(1, 16, 288)
    with pytest.raises(ModelLoadError, match=r"^tensor_parallel_size: an int8 per-channel"):
        quantize_int8(torch.randn(64, K)).narrow(1, 0, 288)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(InvalidInputError) as error:
        EngineConfig(quantization="int3")
    assert error.value.field == "quantization"
    with pytest.raises(InvalidInputError) as error:
        EngineConfig(quantization="int4", quantization_group_size=48)
    assert error.value.field == "quantization_group_size"
    with pytest.raises(InvalidInputError) as error:
        EngineConfig(quantize_lm_head="yes")  # type: ignore[arg-type]
    assert error.value.field == "quantize_lm_head"
    config = EngineConfig(quantization="int4", quantization_group_size=64)
    assert config.quantization_config() == QuantizationConfig("int4", 64, False, False)


def grouped_int8(n: int, group_size: int) -> Int8Weight:
    """int8 with a scale per group of columns, as GGUF Q8_0 (32) and Q6_K (16) repack."""
    weight = torch.randn(n, K, generator=torch.Generator().manual_seed(2)) * 0.05
    return quantize_int8(weight, group_size)


@pytest.mark.parametrize("group_size", [32, 16])  # GGUF Q8_0, Q6_K
def test_grouped_int8_equals_dequantized_reference(group_size: int) -> None:
    exact = grouped_int8(100, group_size)  # 100 rows: padded to the kernel's blocks of 16
    linear = QuantizedLinear(K, 100, False, QuantizationConfig("gguf"))
    linear.set_weight(exact, torch.bfloat16, torch.device("cpu"))
    linear.kernel_max_rows, linear.min_rows = 1 << 62, 1
    assert linear.kind == "int8-grouped" and linear.use_kernel
    # fp32 scales, dequantized exactly as the format
    assert torch.equal(linear.dequantize(torch.float32), exact.dequantize())
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 7, 64, 2048):
        x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
        out = linear(x)
        expected = F.linear(x.float(), exact.dequantize())
        assert out.shape == (rows, 100)
        torch.testing.assert_close(out.float(), expected, rtol=0, atol=expected.abs().max() / 64)
    assert probe(linear, K, torch.bfloat16)
    assert linear.weight_bytes() == 112 * K + 112 * (K // group_size) * 4  # padded to 7 x 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_forward_calls_the_kernel_as_the_general_path_does(
    config: QuantizationConfig, dtype: torch.dtype
) -> None:
    """`forward` calls duet's kernel on [rows, K] inputs itself (no linear_rows or _product
    frames): the same bits, bias included, as the general path at 1 and 5 rows, and 3-D or
    strided inputs and rows past `kernel_max_rows` still take the general path."""
    linear, _ = layer(config, dtype, n=100, bias=True)
    if linear.duet_kernels is None:
        pytest.fail("duet's quantized kernels did not build")
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    for rows in (x[:1], x[:5], x[:, :K]):
        assert torch.equal(linear(rows), linear_rows(rows, linear._product, linear.min_rows))
    assert torch.equal(linear(x.view(2, 3, K)), linear(x).view(2, 3, 100))
    strided = torch.randn(6, 2 * K, generator=torch.Generator().manual_seed(2)).to(dtype)[:, ::2]
    assert torch.equal(linear(strided), linear(strided.contiguous()))
    linear.kernel_max_rows = 4  # past it: the dequantized weight, as before (not the kernel)
    calls: list[int] = []
    kernels = linear.duet_kernels
    linear.duet_kernels = type("Counting", (), {
        "__getattr__": lambda _, name: calls.append(1) or getattr(kernels, name)})()  # fmt: skip
    out = linear(x[:5])
    linear.duet_kernels = kernels
    assert calls == [] and torch.equal(out, linear_rows(x[:5], linear._product, linear.min_rows))


def test_dense_forward_calls_the_kernel_as_the_general_path_does() -> None:
    """The dense `Linear` on duet's kernel: the same bits through its short path and
    `linear_rows`, bias included."""
    from duet.engine.model.dense_cpu_linear import set_dense_kernel

    gen = torch.Generator().manual_seed(3)
    dense = Linear(K, 100, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(100, K, generator=gen) * 0.05)
        dense.bias.copy_(torch.randn(100, generator=gen))
    if not set_dense_kernel([dense]):
        pytest.fail("duet's dense kernel did not build")
    x = torch.randn(5, K, generator=gen).to(torch.bfloat16)
    for rows in (x[:1], x):
        assert torch.equal(dense(rows), linear_rows(rows, dense._product, dense.min_rows))
