"""engine/quant/triton_linear.py: the Triton W8A16 / W4A16 kernels against the dequantized
reference. Without CUDA they run in Triton's interpreter, in fp32 only (its bf16 `tl.dot` is
wrong), at small shapes, with each family of launch configuration (split-K included); on a GPU,
compiled, in bf16 too, and (gpu-marked) at Llama-3.1-8B's shapes with the shipped configs."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from duet.engine.quant.formats import Int8Weight, quantize_int4, quantize_int8
from tests.engine.triton_cases import DEVICE, ON_CUDA

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("triton ships wheels for Linux x86_64 only", allow_module_level=True)

from duet.engine.quant.triton_linear import LaunchConfig  # after the skip: needs triton

DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32]


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def tolerance(dtype: torch.dtype, expected: torch.Tensor) -> dict[str, float]:
    scale = float(expected.abs().max())
    return dict(rtol=0, atol=scale * (1e-5 if dtype == torch.float32 else 1 / 64))


# Explicit launches: a decode tile with K split in 2 and 4 (partial sums added by the second
# kernel), a 64-wide step over 32-column groups (two sub-chunks per step), a wide tile.
CONFIGS = [None, LaunchConfig(16, 32, 32, 2), LaunchConfig(16, 16, 64, 4), LaunchConfig(32, 64, 64)]
CONFIG_IDS = ["shipped", "split2", "split4", "tile32x64"]


def int8_weight(n: int, k: int, group_size: int, gen: torch.Generator) -> Int8Weight:
    return quantize_int8(torch.randn(n, k, generator=gen), group_size)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size", [32, 128], ids=["g32", "per-channel"])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_w8a16_equals_dequantized(
    dtype: torch.dtype, group_size: int, rows: int, config: LaunchConfig | None
) -> None:
    from duet.engine.quant.triton_linear import w8a16_linear

    gen = torch.Generator().manual_seed(rows)
    q8 = int8_weight(80, 128, group_size, gen)  # N off the 32-wide tiles on purpose
    x, bias = torch.randn(rows, 128, generator=gen), torch.randn(80, generator=gen)
    expected = F.linear(x, q8.dequantize(), bias)
    out = w8a16_linear(
        x.to(DEVICE, dtype), q8.q.to(DEVICE), q8.scale.to(DEVICE, dtype), bias.to(DEVICE, dtype),
        config=config,
    )  # fmt: skip
    assert out.shape == (rows, 80) and out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected, **tolerance(dtype, expected))


def test_w8a16_k_off_the_step() -> None:
    """K = 96 per channel: the last 64-wide step is half past K, masked."""
    from duet.engine.quant.triton_linear import w8a16_linear

    gen = torch.Generator().manual_seed(3)
    q8 = int8_weight(48, 96, 96, gen)
    x = torch.randn(5, 96, generator=gen)
    expected = F.linear(x, q8.dequantize())
    for config in (LaunchConfig(16, 16, 64, 1), LaunchConfig(16, 16, 64, 2)):
        out = w8a16_linear(x.to(DEVICE), q8.q.to(DEVICE), q8.scale.to(DEVICE), config=config)
        torch.testing.assert_close(out.cpu(), expected, **tolerance(torch.float32, expected))


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_w4a16_equals_dequantized(
    dtype: torch.dtype, symmetric: bool, rows: int, config: LaunchConfig | None
) -> None:
    from duet.engine.quant.triton_linear import pack_int4_rows, w4a16_linear

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(80, 128, generator=gen)
    q4 = quantize_int4(weight, 32, symmetric)
    zero = -8 * q4.scale if q4.offset is None else q4.offset
    x = torch.randn(rows, 128, generator=gen)
    expected = F.linear(x, q4.dequantize())
    out = w4a16_linear(
        x.to(DEVICE, dtype), pack_int4_rows(q4.q).to(DEVICE), q4.scale.to(DEVICE, dtype),
        zero.to(DEVICE, dtype), config=config,
    )  # fmt: skip
    assert out.shape == (rows, 80) and out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected, **tolerance(dtype, expected))


def test_w4a16_per_channel_zero_uses_the_whole_row_sum() -> None:
    """One group per row (group = K): the zero multiplies the sum of all of x's columns, applied
    after the last step (and after split-K's partial sums)."""
    from duet.engine.quant.triton_linear import pack_int4_rows, w4a16_linear

    gen = torch.Generator().manual_seed(4)
    q4 = quantize_int4(torch.randn(48, 128, generator=gen), 128, False)
    assert q4.offset is not None
    x = torch.randn(3, 128, generator=gen)
    expected = F.linear(x, q4.dequantize())
    packed = pack_int4_rows(q4.q).to(DEVICE)
    for config in (LaunchConfig(16, 16, 32, 1), LaunchConfig(16, 16, 32, 4)):
        out = w4a16_linear(x.to(DEVICE), packed, q4.scale.to(DEVICE), q4.offset.to(DEVICE),
                           config=config)  # fmt: skip
        torch.testing.assert_close(out.cpu(), expected, **tolerance(torch.float32, expected))


def test_split_k_follows_the_grid_and_k() -> None:
    """Decode splits K until the grid has a program per SM (and never below 4 steps a split);
    a wide layer fills the grid without it; fp32 takes the small tiles."""
    from duet.engine.quant.triton_linear import launch_config

    bf16 = torch.bfloat16
    decode = launch_config(1, 4096, 4096, False, bf16, 132)
    assert (decode.bm, decode.bn, decode.bk, decode.split_k) == (16, 32, 256, 2)
    assert launch_config(1, 4096, 14336, True, bf16, 132).split_k == 2  # 128 tiles x 2
    assert launch_config(1, 4096, 14336, True, bf16, 16).split_k == 1  # a small GPU: full
    assert launch_config(1, 1024, 14336, True, bf16, 132).split_k == 8  # 32 tiles x 8
    assert launch_config(1, 28672, 4096, False, bf16, 132).split_k == 1  # 896 tiles already
    assert launch_config(1, 512, 1024, False, bf16, 132).split_k == 1  # 4 steps: no room
    batch = launch_config(100, 4096, 4096, True, bf16, 132)
    assert (batch.bm, batch.bn, batch.bk, batch.split_k) == (64, 64, 64, 2)  # 2 x 64 tiles
    fp32 = launch_config(64, 4096, 4096, False, torch.float32, 132)
    assert (fp32.bm, fp32.bn, fp32.bk) == (32, 32, 32)


@pytest.mark.parametrize("int4", [False, True], ids=["int8", "int4"])
def test_prefill_rows_multiply_the_dequantized_weight(int4: bool, monkeypatch) -> None:
    """Over DEQUANTIZE_ABOVE_ROWS rows the wrappers dequantize the weight (one kernel: the
    format's values in the activations' dtype) and multiply with F.linear; up to it, the fused
    kernel runs."""
    from duet.engine.quant import triton_linear as tlin

    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(80, 128, generator=gen), torch.randn(80, generator=gen)
    x = torch.randn(tlin.DEQUANTIZE_ABOVE_ROWS + 1, 128, generator=gen).to(DEVICE)
    bias = bias.to(DEVICE)
    if int4:
        q4 = quantize_int4(weight, 32, False)
        assert q4.offset is not None
        args = (tlin.pack_int4_rows(q4.q), q4.scale, q4.offset)
        reference = q4.dequantize()
    else:
        q8 = int8_weight(80, 128, 32, gen)
        args = (q8.q, q8.scale, None)
        reference = q8.dequantize()
    args = tuple(None if a is None else a.to(DEVICE) for a in args)
    dense = tlin.dequantize(*args, 128, int4, torch.float32)
    # q * scale (+ offset): exact for int8; one fp32 rounding apart where a GPU fuses the FMA
    torch.testing.assert_close(dense.cpu(), reference, rtol=2e-7, atol=1e-7)
    calls, original = [], tlin.dequantize

    def counted(*a, **kw):
        calls.append(a[0].shape)
        return original(*a, **kw)

    monkeypatch.setattr(tlin, "dequantize", counted)

    def product(rows: torch.Tensor) -> torch.Tensor:
        if int4:
            return tlin.w4a16_linear(rows, *args, bias)  # type: ignore[arg-type]
        return tlin.w8a16_linear(rows, args[0], args[1], bias)

    assert torch.equal(product(x), F.linear(x, dense, bias))
    assert len(calls) == 1
    torch.testing.assert_close(product(x[:-1]), F.linear(x[:-1], dense, bias), rtol=0, atol=1e-4)
    assert len(calls) == 1  # 128 rows: the fused kernel, no dequantized weight


def test_bad_group_is_refused() -> None:
    from duet.engine.quant.triton_linear import w8a16_linear

    x = torch.randn(2, 96, device=DEVICE)
    q = torch.zeros(16, 96, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="group size 48"):  # 96 / 2 groups: 48 columns each
        w8a16_linear(x, q, torch.ones(16, 2, device=DEVICE), config=LaunchConfig(16, 16, 64))


def test_int4_row_layout_packs_pairs() -> None:
    from duet.engine.quant.triton_linear import pack_int4_rows

    q = torch.tensor([[1, 2, 15, 0], [7, 8, 3, 12]])
    assert pack_int4_rows(q).tolist() == [[0x21, 0x0F], [0x87, 0xC3]]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_linear_runs_the_triton_kernels(method: str) -> None:
    from duet.engine.model.quantized_linear import QuantizedLinear
    from duet.engine.quant.config import QuantizationConfig

    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    layer = QuantizedLinear(64, 96, True, QuantizationConfig(method, 32))
    exact = quantize_int8(weight) if method == "int8" else quantize_int4(weight, 32, False)
    layer.bias.data = bias.to(DEVICE)
    layer.set_weight(exact, torch.float32, DEVICE, triton=True)  # on a GPU: the default
    assert layer.use_triton and not layer.use_kernel
    torch.testing.assert_close(layer.dequantize(torch.float32).cpu(), exact.dequantize())
    x = torch.randn(5, 64, generator=gen)
    expected = F.linear(x, exact.dequantize(), bias)
    out = layer(x.to(DEVICE)).cpu()
    torch.testing.assert_close(out, expected, **tolerance(torch.float32, expected))


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills() -> None:
    """What the interpreter lets through (tl.dot shapes and operand types, constexpr use) fails
    here: every variant compiled to SASS for an H100, on this machine, without a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))  # and packages beside
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "tests/engine/quant_sm90_compile.py")],
        capture_output=True, text=True, timeout=300, env={**env, "PYTHONPATH": path}, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    usage = json.loads(proc.stdout)
    formats = ("w8a16/channel", "w8a16/g32", "w4a16/g32", "w4a16/g128")
    rows = ("decode", "batch64", "batch128", "dequantize")
    dtypes = ("bfloat16", "float16", "float32")
    expected = [f"{d}/{f}/{r}" for d in dtypes for f in formats for r in rows]
    expected += [f"{d}/split_k_sum/{s}" for d in dtypes for s in (2, 16)]
    assert sorted(usage) == sorted(expected)
    for name, u in usage.items():
        assert (u["spill_stores"], u["spill_loads"], u["stack"]) == (0, 0, 0), (name, u)
        assert u["regs"] <= 255 and u["shared_bytes"] <= 227 * 1024, name
    # the decode launches split K at Llama-8B's 4096 x 4096 (2 splits of 8 steps)
    assert usage["bfloat16/w8a16/channel/decode"]["config"][3] == 2


LLAMA8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA: the interpreter's bf16 tl.dot is wrong")
@pytest.mark.parametrize("layer", list(LLAMA8B))
def test_llama8b_shapes_in_bf16_on_gpu(layer: str) -> None:
    """Compiled, bf16, the shipped configurations at 1, 16, 64, 300 and 2,048 rows (decode
    split-K, the 64-row tiles, then the dequantized weight with cuBLAS): int8 per channel, int8 in groups of
    32 (GGUF Q8_0), int4 in groups of 32 and 128, against the dequantized weight in fp32."""
    from duet.engine.quant.triton_linear import pack_int4_rows, w4a16_linear, w8a16_linear

    n, k = LLAMA8B[layer]
    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen, device=DEVICE) * 0.02
    formats = {
        "int8": quantize_int8(weight),
        "int8-g32": quantize_int8(weight, 32),
        "int4-g32": quantize_int4(weight, 32, False),
        "int4-g128-sym": quantize_int4(weight, 128, True),
    }
    for rows in (1, 16, 64, 300, 2048):
        x = torch.randn(rows, k, generator=gen, device=DEVICE).to(torch.bfloat16)
        for name, w in formats.items():
            expected = F.linear(x.float(), w.dequantize().float())
            if isinstance(w, Int8Weight):
                out = w8a16_linear(x, w.q, w.scale.to(torch.bfloat16))
            else:
                zero = -8 * w.scale if w.offset is None else w.offset
                out = w4a16_linear(x, pack_int4_rows(w.q), w.scale.to(torch.bfloat16),
                                   zero.to(torch.bfloat16))  # fmt: skip
            # bf16 scales and output: a few bf16 ulps of the largest output
            scale = float(expected.abs().max())
            torch.testing.assert_close(out.float(), expected, rtol=0, atol=scale / 64,
                                       msg=lambda m, r=rows, f=name: f"{f} at {r} rows: {m}")  # fmt: skip
