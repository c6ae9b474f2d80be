"""engine/quant/triton_linear.py: the Triton W8A16 / W4A16 kernels against the dequantized
reference. Without CUDA they run in Triton's interpreter, in fp32 only (its bf16 `tl.dot` is
wrong), at small shapes; on a GPU, compiled, in bf16 too."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine.quant.formats import quantize_int4, quantize_int8
from tests.engine.triton_cases import DEVICE, ON_CUDA

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("triton ships wheels for Linux x86_64 only", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32]


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def tolerance(dtype: torch.dtype, expected: torch.Tensor) -> dict[str, float]:
    scale = float(expected.abs().max())
    return dict(rtol=0, atol=scale * (1e-5 if dtype == torch.float32 else 1 / 64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size", [32, 96], ids=["g32", "per-channel"])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_w8a16_equals_dequantized(dtype: torch.dtype, group_size: int, rows: int) -> None:
    from engine.quant.triton_linear import w8a16_linear

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(80, 96, generator=gen)  # N, K off the 32-wide blocks on purpose
    q8 = quantize_int8(weight)
    if group_size != 96:  # per-group scales, as GGUF Q8_0 gives
        groups = weight.view(80, -1, group_size)
        scale = groups.abs().amax(-1) / 127
        q = torch.round(groups / scale[..., None]).clamp(-127, 127).to(torch.int8)
        q8 = type(q8)(q.view(80, 96), scale, group_size)
    x = torch.randn(rows, 96, generator=gen)
    expected = F.linear(x, q8.dequantize())
    out = w8a16_linear(
        x.to(DEVICE, dtype), q8.q.to(DEVICE), q8.scale.to(DEVICE, dtype)
    )  # fmt: skip
    assert out.shape == (rows, 80) and out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected, **tolerance(dtype, expected))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_w4a16_equals_dequantized(dtype: torch.dtype, symmetric: bool, rows: int) -> None:
    from engine.quant.triton_linear import pack_int4_rows, w4a16_linear

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(80, 128, generator=gen)
    q4 = quantize_int4(weight, 32, symmetric)
    zero = -8 * q4.scale if q4.offset is None else q4.offset
    x = torch.randn(rows, 128, generator=gen)
    expected = F.linear(x, q4.dequantize())
    out = w4a16_linear(
        x.to(DEVICE, dtype), pack_int4_rows(q4.q).to(DEVICE), q4.scale.to(DEVICE, dtype),
        zero.to(DEVICE, dtype),
    )  # fmt: skip
    assert out.shape == (rows, 80) and out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected, **tolerance(dtype, expected))


def test_int4_row_layout_packs_pairs() -> None:
    from engine.quant.triton_linear import pack_int4_rows

    q = torch.tensor([[1, 2, 15, 0], [7, 8, 3, 12]])
    assert pack_int4_rows(q).tolist() == [[0x21, 0x0F], [0x87, 0xC3]]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_linear_runs_the_triton_kernels(method: str) -> None:
    from engine.model.quantized_linear import QuantizedLinear
    from engine.quant.config import QuantizationConfig

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
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "tests/engine/quant_sm90_compile.py")],
        capture_output=True, text=True, timeout=300, env={**env, "PYTHONPATH": root}, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    usage = json.loads(proc.stdout)
    kernels = ("w8a16/g32", "w8a16/channel", "w4a16/g32", "w4a16/g128")
    dtypes = ("bfloat16", "float16", "float32")
    assert sorted(usage) == sorted(f"{d}/{k}" for d in dtypes for k in kernels)
    for name, u in usage.items():
        assert (u["spill_stores"], u["spill_loads"], u["stack"]) == (0, 0, 0), (name, u)
        assert u["regs"] <= 255 and u["shared_bytes"] <= 227 * 1024, name
