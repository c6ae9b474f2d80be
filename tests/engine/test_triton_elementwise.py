"""The decoder layer's small operators as Triton kernels (engine/kernels/triton_elementwise.py),
interpreted on the CPU at Llama-3.1-8B and SmolLM2 shapes (compiled on CUDA): each against the
torch code the model runs without them, each row's bits independent of the batch, and the
dispatch that gives CUDA tensors these kernels and CPU tensors the C++ ones.

Exact where the arithmetic is the same: fp32 in the interpreter (numpy, no FMA contraction).
The interpreter rounds fp32 to bf16 by truncation (`cast_impl` passes no rounding mode), not to
nearest even as the GPU's cvt.rn does, so its bf16 results are compared within one bf16 ulp;
on CUDA, bf16 sums rounded once are exact and the rest within torch's tolerance. Rows alone
and in a batch are compared exactly everywhere."""

from __future__ import annotations

import platform
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.engine.triton_cases import DEVICE, ON_CUDA, triton_interpreter  # noqa: F401

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("triton ships wheels for Linux x86_64 only", allow_module_level=True)

DTYPES = (torch.float32, torch.bfloat16)
# (hidden, intermediate, heads, kv heads, head_dim): Llama-3.1-8B, SmolLM2-135M
SHAPES = {"llama8b": (4096, 14336, 32, 8, 128), "smollm2": (576, 1536, 9, 3, 64)}


def _same_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal where the kernel rounds as torch does; within the rounding step elsewhere."""
    if got.dtype == torch.float32 and not ON_CUDA:
        assert torch.equal(got, want)
    elif got.dtype == torch.bfloat16 and not ON_CUDA:  # truncated, not rounded: one ulp
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-30)
    else:  # compiled: FMA contraction may move the last bit
        torch.testing.assert_close(got, want)


def _rand(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", SHAPES)
def test_fused_add_rms_norm_against_torch_and_alone_vs_batched(model: str, dtype: torch.dtype):
    from duet.engine.kernels.triton_elementwise import fused_add_rms_norm

    hidden = SHAPES[model][0]
    x, residual = _rand(19, hidden, seed=1, dtype=dtype), _rand(19, hidden, seed=2, dtype=dtype)
    weight = _rand(hidden, seed=3, dtype=dtype)
    want_residual = residual + x  # HF: the sum in the model's dtype, then the norm
    out, res = x.clone(), residual.clone()
    fused_add_rms_norm(out, res, weight, 1e-5)
    rf = res.float()  # the norm of the kernel's own sum (in the interpreter: truncated)
    want = weight * (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    if dtype == torch.bfloat16 and ON_CUDA:
        assert torch.equal(res, want_residual)  # one sum rounded once, as torch does
    else:
        _same_rounding(res, want_residual)
    # the row's reduction order is the kernel's own: within an ulp of torch's mean
    if dtype == torch.float32:
        torch.testing.assert_close(out, want)
    else:
        # two roundings (the normalised row, the weight's product): two ulps
        torch.testing.assert_close(out.float(), want.float(), rtol=2 * 2**-7, atol=1e-30)
    alone_x, alone_res = x[7:8].clone(), residual[7:8].clone()
    fused_add_rms_norm(alone_x, alone_res, weight, 1e-5)
    assert torch.equal(alone_x[0], out[7]) and torch.equal(alone_res[0], res[7])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", SHAPES)
def test_rotary_embedding_in_place_equals_the_torch_path(model: str, dtype: torch.dtype):
    from duet.engine.kernels.triton_elementwise import rotary_embedding
    from duet.engine.model.rotary import RotaryEmbedding, _rotate

    _, _, heads, kv_heads, head_dim = SHAPES[model]
    tokens = 13
    rope = RotaryEmbedding(head_dim, 8192, 500000.0)
    rope.rebuild(DEVICE)
    qkv = _rand(tokens, (heads + 2 * kv_heads) * head_dim, seed=4, dtype=dtype)
    q_all, k_all, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k = q_all.view(tokens, heads, head_dim), k_all.view(tokens, kv_heads, head_dim)
    g = torch.Generator(device=DEVICE).manual_seed(5)
    positions = torch.randint(0, 8192, (tokens,), generator=g, device=DEVICE)
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    want_q, want_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    rotary_embedding(positions, q, k, rope.cos, rope.sin)  # views of qkv: rotated in place
    _same_rounding(q, want_q)
    _same_rounding(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", SHAPES)
def test_rotary_and_store_is_the_two_kernels_in_one(model: str, dtype: torch.dtype):
    """`rotary_embedding_and_store`: bitwise `rotary_embedding` then the KV write (in place q
    and k, the cache's K and V at each slot), a slot of -1 rotated but not stored."""
    from duet.engine.kernels.triton_cache import write_kv_cache
    from duet.engine.kernels.triton_elementwise import (
        rotary_embedding,
        rotary_embedding_and_store,
    )
    from duet.engine.model.rotary import RotaryEmbedding

    _, _, heads, kv_heads, head_dim = SHAPES[model]
    tokens, block_size, num_blocks = 7, 16, 4
    rope = RotaryEmbedding(head_dim, 8192, 500000.0)
    rope.rebuild(DEVICE)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    g = torch.Generator(device=DEVICE).manual_seed(5)
    positions = torch.randint(0, 8192, (tokens,), generator=g, device=DEVICE)
    slots = torch.tensor([3, 17, 18, -1, 40, 63, 0], device=DEVICE)
    results = []
    for fused in (False, True):
        qkv = _rand(tokens, sum(sizes), seed=4, dtype=dtype)
        q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split(sizes, -1))
        cache = _rand(2, num_blocks, block_size, kv_heads, head_dim, seed=6, dtype=dtype)
        if fused:
            rotary_embedding_and_store(positions, q, k, v, rope.cos, rope.sin, cache, slots)
        else:
            rotary_embedding(positions, q, k, rope.cos, rope.sin)
            write_kv_cache(cache, k, v, slots)
        results.append((qkv, cache))
    (want_qkv, want_cache), (got_qkv, got_cache) = results
    assert torch.equal(got_qkv, want_qkv)
    assert torch.equal(got_cache, want_cache)
    untouched = _rand(2, num_blocks, block_size, kv_heads, head_dim, seed=6, dtype=dtype)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[[3, 17, 18, 40, 63, 0]] = True
    flat = got_cache.view(2, -1, kv_heads, head_dim)
    assert torch.equal(flat[:, ~written], untouched.view(2, -1, kv_heads, head_dim)[:, ~written])
    assert not torch.equal(flat[:, written], untouched.view(2, -1, kv_heads, head_dim)[:, written])


def test_rotary_embedding_refuses_heads_that_are_not_contiguous():
    from duet.engine.kernels.triton_elementwise import rotary_embedding

    q = torch.zeros(2, 8, 4, device=DEVICE).transpose(1, 2)  # [2, 4 heads, 8]: heads strided
    k = torch.zeros(2, 4, 8, device=DEVICE)
    table = torch.zeros(16, 4, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="q: each token's heads must be contiguous"):
        rotary_embedding(positions, q, k, table, table)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", SHAPES)
def test_silu_and_mul_against_torch(model: str, dtype: torch.dtype):
    from duet.engine.kernels.triton_elementwise import silu_and_mul

    inter = SHAPES[model][1]
    gate_up = _rand(5, 2 * inter, seed=6, dtype=dtype) * 4
    gate, up = gate_up.split(inter, dim=-1)
    want = F.silu(gate) * up  # the MLP's torch path: SiLU rounded, then the product
    got = silu_and_mul(gate_up)
    assert got.shape == (5, inter) and got.is_contiguous()
    if dtype == torch.float32:  # exp's last bits are the library's
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # rounded to bf16 twice (SiLU, then the product): within two ulps
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * 2**-7, atol=1e-30)
    assert torch.equal(silu_and_mul(gate_up[2:3].clone())[0], got[2])  # alone == in the batch


def test_cuda_tensors_get_the_triton_operators_and_cpu_tensors_the_cpp_ones():
    from duet.engine import kernels
    from duet.engine.kernels import triton_elementwise
    from duet.engine.kernels.cpu import kernels_for

    cpu = torch.zeros(2, 4)
    assert kernels.fused_ops_for(cpu) is kernels_for(cpu)
    if ON_CUDA:
        assert kernels.fused_ops_for(cpu.cuda()) is triton_elementwise
        assert kernels.fused_ops_for(cpu.cuda().to(torch.int32)) is None
    for name in ("fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"):
        assert callable(getattr(triton_elementwise, name))  # the CPU module's calls, by name
        assert callable(getattr(kernels_for(cpu), name))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
def test_every_operator_compiled_on_cuda():
    """`make gpu-check` (`pytest -m gpu`): the checks above, compiled, at both shapes."""
    for model in SHAPES:
        for dtype in DTYPES:
            test_fused_add_rms_norm_against_torch_and_alone_vs_batched(model, dtype)
            test_rotary_embedding_in_place_equals_the_torch_path(model, dtype)
            test_rotary_and_store_is_the_two_kernels_in_one(model, dtype)
            test_silu_and_mul_against_torch(model, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: per-head q/k norms too
def test_the_model_on_cuda_gives_the_same_tokens_with_and_without_them(
    tiny_model_factory, monkeypatch, arch
):
    """fp32 on CUDA: greedy tokens with the Triton operators equal torch's paths' tokens."""
    from duet.engine import LLM, SamplingParams
    from duet.engine.model import mlp, norm, rotary

    model_dir = tiny_model_factory(arch)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 40, 130)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    fused = LLM(model_dir, dtype="float32", device="cuda", load_progress=False)
    fast = [o.outputs[0].token_ids for o in fused.generate(prompts, params)]
    del fused
    for module in (norm, rotary, mlp):
        monkeypatch.setattr(module, "fused_ops_for", lambda x: None)
    plain = LLM(model_dir, dtype="float32", device="cuda", load_progress=False)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == fast
