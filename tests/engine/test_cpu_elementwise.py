"""The C++ CPU kernels' elementwise ops (RMS norm with the fused residual add, rotary, SiLU
and mul, row copies) against HF's formulas and torch, fp32 and bf16, one and two threads; bad
inputs rejected; a whole model with and without the kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from duet.engine import LLM, SamplingParams
from duet.engine.kernels.cpu import kernels_for
from duet.engine.model import mlp, norm, rotary
from duet.engine.model.rotary import RotaryEmbedding, _rotate


def hf_rms_norm(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def close(dtype):
    # fp32: a few ulp (summation order, fused multiply-adds); bf16: torch's default (1 ulp).
    return {"atol": 2e-6, "rtol": 2e-6} if dtype == torch.float32 else {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [576, 37])
def test_rms_norm_and_fused_residual_add_match_hf(kernels, threads, dtype, width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(70, width, generator=g).to(dtype)
    residual = torch.randn(70, width, generator=g).to(dtype)
    weight = (torch.rand(width, generator=g) + 0.5).to(dtype)
    torch.testing.assert_close(
        kernels.rms_norm(x, weight, 1e-5), hf_rms_norm(x, weight, 1e-5), **close(dtype)
    )
    summed = residual + x
    kernels.fused_add_rms_norm(x, residual, weight, 1e-6)  # both in place
    assert torch.equal(residual, summed)  # the same rounded add as torch's
    torch.testing.assert_close(x, hf_rms_norm(summed, weight, 1e-6), **close(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 20])
def test_rotary_in_place_matches_torch_path(kernels, threads, dtype, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0)
    qkv = torch.randn(41, 14 * head_dim, generator=g).to(dtype)  # q: 9 heads, k and v: 3 + 2
    q = qkv[:, : 9 * head_dim].view(41, 9, head_dim)
    k = qkv[:, 9 * head_dim : 12 * head_dim].view(41, 3, head_dim)
    rest = qkv[:, 12 * head_dim :].clone()
    positions = torch.randint(0, 4096, (41,), generator=g)
    cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
    want_q, want_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    kernels.rotary_embedding(positions, q, k, rotary.cos, rotary.sin)
    torch.testing.assert_close(q, want_q, **close(dtype))
    torch.testing.assert_close(k, want_k, **close(dtype))
    assert torch.equal(qkv[:, 12 * head_dim :], rest)


def test_rotary_rejects_positions_past_the_table(kernels):
    rotary = RotaryEmbedding(16, 32, 10000.0)
    q, k = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
    with pytest.raises(RuntimeError, match=r"positions\[1\] = 32 outside \[0, 32\)"):
        kernels.rotary_embedding(torch.tensor([0, 32]), q, k, rotary.cos, rotary.sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [1536, 37])
def test_silu_and_mul_matches_torch(kernels, threads, dtype, width):
    g = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(33, 2 * width, generator=g) * 4).to(dtype)
    gate, up = gate_up.split(width, dim=-1)
    want = F.silu(gate) * up
    out = kernels.silu_and_mul(gate_up)
    assert out.data_ptr() == gate_up.data_ptr() and out.shape == (33, width)  # over the gate
    torch.testing.assert_close(out, want, **close(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_copy_rows_equals_index_copy(kernels, threads, dtype):
    g = torch.Generator().manual_seed(3)
    dst = torch.randint(-100, 100, (40, 24), generator=g).to(dtype)
    wide = torch.randint(-100, 100, (9, 30), generator=g).to(dtype)
    src = wide[:, 3:27]  # rows with a stride larger than their length
    dst_rows, src_rows = torch.tensor([5, 39, 0, 17, 6]), torch.tensor([8, 0, 3, 3, 1])
    want = dst.clone()
    want.index_copy_(0, dst_rows, src[src_rows])
    kernels.copy_rows(dst, dst_rows, src, src_rows)
    assert torch.equal(dst, want)


@pytest.mark.parametrize(
    ("dst_rows", "src_rows", "message"),
    [
        ([0, 40], [0, 1], r"dst_rows\[1\] = 40 is outside \[0, 40\)"),
        ([0, 1], [-1, 1], r"src_rows\[0\] = -1 is outside \[0, 9\)"),
        ([0, 1], [0], "differ in length"),
    ],
)
def test_copy_rows_rejects_bad_indices(kernels, dst_rows, src_rows, message):
    dst, src = torch.zeros(40, 8), torch.ones(9, 8)
    with pytest.raises(RuntimeError, match=message):
        kernels.copy_rows(dst, torch.tensor(dst_rows), src, torch.tensor(src_rows))
    assert not dst.any()  # nothing written


def test_copy_rows_rejects_mismatched_rows(kernels):
    with pytest.raises(RuntimeError, match="differ in length: 8 vs 6"):
        kernels.copy_rows(torch.zeros(4, 8), torch.tensor([0]), torch.ones(4, 6), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.copy_rows(
            torch.zeros(4, 8), torch.tensor([0]), torch.ones(4, 8).double(), torch.tensor([0])
        )


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_torch_fallbacks_match_kernels(kernels, tiny_model_factory, monkeypatch, arch):
    """The same model with every kernel (attention, norms fused with residual adds, rotary,
    SiLU) and with none (their torch paths): identical greedy tokens, logprobs within 1e-4."""
    model_dir = tiny_model_factory(arch)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 40, 130)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    assert kernels_for(torch.zeros(1)) is kernels
    fast = LLM(model_dir, dtype="float32", load_progress=False).generate(prompts, params)
    for module in (norm, rotary, mlp):
        monkeypatch.setattr(module, "fused_ops_for", lambda x: None)
    llm = LLM(model_dir, dtype="float32", attention_backend="torch", load_progress=False)
    slow = llm.generate(prompts, params)
    for a, b in zip(fast, slow, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x.sampled.logprob - y.sampled.logprob) < 1e-4
