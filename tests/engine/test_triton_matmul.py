"""The batch-invariant Triton matrix product (engine/kernels/triton_matmul.py): a row's bits do
not depend on how many rows share the product, nor on which row of a tile it lands in; and
the result is x @ w.T. Interpreted in fp32 without CUDA (the interpreter's 16-bit `tl.dot` is
wrong); compiled and in bf16 on a GPU (`make gpu-check`)."""

from __future__ import annotations

import platform
import sys

import pytest
import torch

from tests.engine.triton_cases import DEVICE, ON_CUDA, triton_interpreter  # noqa: F401

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("triton ships wheels for Linux x86_64 only", allow_module_level=True)

K, N = 576, 72  # SmolLM2's hidden size; an output width that is not a tile multiple
ROWS = (1, 7, 45, 64, 300)


def operands(dtype: torch.dtype, bias: bool):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(max(ROWS), K, generator=g, device=DEVICE).to(dtype)
    w = (torch.randn(N, K, generator=g, device=DEVICE) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g, device=DEVICE).to(dtype) if bias else None
    return x, w, b


def check_rows_invariant(dtype: torch.dtype, bias: bool, tol: dict[str, float]) -> None:
    from duet.engine.kernels.triton_matmul import invariant_linear

    x, w, b = operands(dtype, bias)
    full = invariant_linear(x, w, b)
    for rows in ROWS:  # row i of every prefix batch, at the same place in its tile
        assert torch.equal(invariant_linear(x[:rows], w, b), full[:rows]), rows
    for i in (0, 6, 33, 299):  # row i alone: row 0 of its only tile
        assert torch.equal(invariant_linear(x[i : i + 1], w, b)[0], full[i]), i
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(full.float(), ref, **tol)


@pytest.mark.parametrize("bias", [False, True])
def test_each_row_is_bitwise_the_same_at_any_batch_size_fp32(bias):
    check_rows_invariant(torch.float32, bias, dict(atol=1e-4, rtol=1e-4))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA: the interpreter's bf16 tl.dot is wrong")
def test_each_row_is_bitwise_the_same_at_any_batch_size_bf16_on_gpu():
    check_rows_invariant(torch.bfloat16, True, dict(atol=3e-2, rtol=3e-2))


def test_bad_shapes_are_refused():
    from duet.engine.kernels.triton_matmul import invariant_linear

    x, w, _ = operands(torch.float32, False)
    with pytest.raises(ValueError, match="x must be"):
        invariant_linear(x[:, :10], w)
    with pytest.raises(ValueError, match="share a dtype"):
        invariant_linear(x, w.double())


def test_rms_norm_rows_are_bitwise_the_same_at_any_batch_size():
    from duet.engine.kernels.triton_norm import rms_norm
    from duet.engine.model.llama import RMSNorm

    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(300, K, generator=g, device=DEVICE)
    norm = RMSNorm(K, 1e-5).to(DEVICE)
    norm.weight.data = torch.rand(K, generator=g, device=DEVICE) + 0.5
    full = rms_norm(x, norm.weight, norm.eps)
    for rows in ROWS:
        assert torch.equal(rms_norm(x[:rows], norm.weight, norm.eps), full[:rows]), rows
    torch.testing.assert_close(full, norm._norm(x), atol=1e-5, rtol=1e-5)
