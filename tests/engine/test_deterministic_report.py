"""What an engine reports as `deterministic` (docs/determinism.md), and the loader's switch to
the batch-invariant Triton kernels on CUDA; on the CPU, with CUDA faked where needed."""

from __future__ import annotations

import pytest
import torch

from duet.engine.config import EngineConfig, reports_deterministic
from duet.engine.errors import InvalidInputError
from duet.engine.model.llama import RMSNorm
from duet.engine.model.row_invariant import Linear, TiedLinear

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    ("value", "on_cpu", "on_cuda"),
    [(None, True, False), (True, True, True), (False, False, False)],
)
def test_deterministic_is_on_by_default_on_the_cpu_only(value, on_cpu, on_cuda):
    """Unset: on for the CPU, off on CUDA, where it measured 1.7x prefill time (H100)."""
    config = EngineConfig(deterministic=value)
    assert config.resolve_deterministic(CPU) is on_cpu
    assert config.resolve_deterministic(CUDA) is on_cuda


def test_deterministic_must_be_a_bool_or_unset():
    with pytest.raises(InvalidInputError, match="must be true, false or unset; got 'yes'"):
        EngineConfig(deterministic="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("linears", "cpu_kernel", "expected"),
    [(True, True, True), (False, True, False), (True, False, False)],
)
def test_cpu_report_is_the_probe_and_the_prefill_kernel(linears, cpu_kernel, expected):
    for triton_attention, tp in ((False, 1), (True, 2)):  # neither matters on the CPU
        assert reports_deterministic(CPU, linears, cpu_kernel, triton_attention, tp) is expected


@pytest.mark.parametrize(
    ("linears", "triton_attention", "tp", "expected"),
    [
        (True, True, 1, True),  # Triton matmuls, norms and attention on one GPU
        (False, True, 1, False),  # cuBLAS, or quantized layers, or --no-deterministic
        (True, False, 1, False),  # the torch attention path (SDPA)
        (True, True, 2, False),  # NCCL's all-reduce algorithm depends on the message size
    ],
)
def test_cuda_report(linears, triton_attention, tp, expected):
    # the CPU's C++ prefill kernel never runs on CUDA
    assert reports_deterministic(CUDA, linears, False, triton_attention, tp) is expected


def layers(net):
    products = [m for m in net.modules() if isinstance(m, Linear | TiedLinear)]
    norms = [m for m in net.modules() if isinstance(m, RMSNorm)]
    return products, norms


@pytest.mark.parametrize("arch", ["smollm2", "qwen3"])  # tied head; q/k norms
def test_loader_routes_every_product_and_norm_to_triton_on_cuda(
    tiny_model_factory, monkeypatch, cpu_kernels_off, arch
):
    from duet.engine.kernels import triton_runtime
    from duet.engine.loader import _use_invariant_cuda_kernels, load_model

    # cpu_kernels_off: the layers a CUDA model has (none packed)
    loaded = load_model(
        tiny_model_factory(arch), torch.float32, CPU, progress=False, deterministic=False
    )
    net = loaded.model
    products, norms = layers(net)
    assert products and norms
    assert not any(m.invariant_gemm for m in products) and not any(m.invariant for m in norms)

    monkeypatch.setattr(triton_runtime, "triton_unusable_reason", lambda device: "no triton")
    assert _use_invariant_cuda_kernels(net) is False  # nothing switched where Triton can't run
    assert not any(m.invariant_gemm for m in products)

    monkeypatch.setattr(triton_runtime, "triton_unusable_reason", lambda device: None)
    ids = torch.tensor([3, 1, 4, 1, 5])
    before = net.compute_logits(net.embed_tokens(ids))
    assert _use_invariant_cuda_kernels(net) is True
    assert all(m.invariant_gemm for m in products) and all(m.invariant for m in norms)
    expected_heads = 1 if arch == "smollm2" else 0
    assert sum(isinstance(m, TiedLinear) for m in products) == expected_heads
    # the switches act on CUDA tensors only: CPU results are unchanged
    assert torch.equal(net.compute_logits(net.embed_tokens(ids)), before)
