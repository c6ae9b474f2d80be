"""Quantized models end to end: `LLM(quantization=...)` on tiny random models (HF format),
batch invariance with quantized weights, weight bytes, and tensor-parallel shards."""

from __future__ import annotations

import random

import pytest
import torch

from duet.engine import LLM, SamplingParams
from duet.engine.loader import load_model
from duet.engine.model.quantized_linear import QuantizedLinear
from duet.engine.model.row_invariant import Linear
from duet.engine.model.weight_bytes import weight_bytes
from duet.engine.parallel import TensorParallel
from duet.engine.quant.config import QuantizationConfig
from duet.engine.quant.cpu_linear import load_quant_kernels
from tests.conftest import SMOLLM2_SHAPES

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def smollm2_shaped_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama", **SMOLLM2_SHAPES)


def _result(out) -> tuple[list[int], list]:
    sample = out.outputs[0]
    lps = [
        (lp.sampled.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in sample.logprobs
    ]
    return sample.token_ids, lps


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 70))] for _ in range(n)]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_bf16_quantized_alone_equals_batched(smollm2_shaped_path: str, quantization: str) -> None:
    llm = LLM(
        smollm2_shaped_path, dtype="bfloat16", quantization=quantization, quantize_lm_head=True,
        load_progress=False, num_kv_blocks=200, enable_prefix_caching=False,
    )  # fmt: skip
    model = llm.engine.runner.model
    kernels = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(kernels) == 2 * 4 + 1  # q|k|v, o, gate|up, down per layer, and the LM head
    assert all(m.use_kernel and m.kind == quantization for m in kernels)
    assert llm.engine.deterministic
    prompts = _prompts(4)
    batch = [_result(o) for o in llm.generate(prompts, PARAMS)]
    alone = [_result(llm.generate([p], PARAMS)[0]) for p in prompts]
    assert batch == alone
    assert all(len(tokens) == 8 for tokens, _ in batch)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_fp32_quantized_model_is_the_model_of_its_dequantized_weights(
    tiny_llama: str, quantization: str
) -> None:
    llm = LLM(
        tiny_llama, dtype="float32", quantization=quantization, load_progress=False,
        num_kv_blocks=100, enable_prefix_caching=False,
    )  # fmt: skip
    prompts = _prompts(3)
    quantized = [_result(o) for o in llm.generate(prompts, PARAMS)]
    model = llm.engine.runner.model
    kernels = {m.use_kernel for m in model.modules() if isinstance(m, QuantizedLinear)}
    assert kernels == {load_quant_kernels() is not None}  # duet's kernels serve both formats
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantizedLinear):
                dense = Linear(child.in_features, child.out_features, bias=child.bias is not None)
                dense.weight.data = child.dequantize(torch.float32)
                if child.bias is not None:
                    dense.bias.data = child.bias.data
                dense.min_rows = child.min_rows
                setattr(parent, name, dense.requires_grad_(False))
                swapped += 1
    assert swapped == 2 * 4
    dense_results = [_result(o) for o in llm.generate(prompts, PARAMS)]
    if kernels == {False}:  # dequantized, then the dense product: the same bits
        assert dense_results == quantized
        return
    # duet's kernels sum in another order than the dense GEMM: a few fp32 ulps
    for (tokens, lps), (dense_tokens, dense_lps) in zip(quantized, dense_results, strict=True):
        assert tokens == dense_tokens
        for (lp, top), (dense_lp, dense_top) in zip(lps, dense_lps, strict=True):
            assert lp == pytest.approx(dense_lp, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in dense_top]
            assert [v for _, v in top] == pytest.approx([v for _, v in dense_top], abs=1e-4)


def test_weight_bytes_at_load(smollm2_shaped_path: str) -> None:
    dense = load_model(
        smollm2_shaped_path, torch.bfloat16, CPU, progress=False, deterministic=False
    )
    int4 = load_model(
        smollm2_shaped_path, torch.bfloat16, CPU, progress=False, deterministic=False,
        quantization=QuantizationConfig("int4", 64),
    )  # fmt: skip
    linears = [m for m in int4.model.modules() if isinstance(m, QuantizedLinear)]
    dense_linear_bytes = sum(m.in_features * m.out_features * 2 for m in linears)
    quantized_bytes = weight_bytes(int4.model)[1]
    assert quantized_bytes == sum(m.weight_bytes() for m in linears)
    assert quantized_bytes / dense_linear_bytes == pytest.approx(0.28125)  # 4 + 0.5 bits
    assert int4.weight_bytes == dense.weight_bytes - dense_linear_bytes + quantized_bytes


def test_tensor_parallel_ranks_hold_their_shard_of_the_quantized_weights(tiny_llama: str) -> None:
    config = QuantizationConfig("int4", 32, symmetric=False)
    full = load_model(tiny_llama, torch.float32, CPU, progress=False, deterministic=False,
                      quantization=config).model  # fmt: skip
    q_size, kv_size = 64, 32  # 4 heads and 2 KV heads of 16
    for rank in range(2):
        tp = TensorParallel(rank=rank, world_size=2)
        shard = load_model(tiny_llama, torch.float32, CPU, progress=False, deterministic=False,
                           tp=tp, quantization=config).model  # fmt: skip
        for whole, part in zip(full.layers, shard.layers, strict=True):
            qkv = whole.self_attn.qkv_proj.dequantize(torch.float32)
            q, k, v = qkv.split([q_size, kv_size, kv_size])
            half = [t.chunk(2)[rank] for t in (q, k, v)]
            assert torch.equal(part.self_attn.qkv_proj.dequantize(torch.float32), torch.cat(half))
            # Row-parallel: the rank's input columns, whose groups are the whole's groups.
            o = whole.self_attn.o_proj.dequantize(torch.float32)
            assert torch.equal(part.self_attn.o_proj.dequantize(torch.float32), o.chunk(2, 1)[rank])
            down = whole.mlp.down_proj.dequantize(torch.float32)
            assert torch.equal(part.mlp.down_proj.dequantize(torch.float32), down.chunk(2, 1)[rank])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled Triton kernels")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_model_on_cuda(tiny_llama: str, quantization: str) -> None:
    """On a GPU every quantized layer runs the Triton kernels: in fp32 the greedy tokens are the
    dequantized model's (logprobs within fp32 noise); in bf16 the CUDA-graph decode (rows padded
    to its batch sizes, where cuBLAS may pick other kernels for the dense head) gives the eager
    decode's tokens, logprobs within bf16 noise."""
    kwargs = dict(quantization=quantization, load_progress=False, num_kv_blocks=100,
                  enable_prefix_caching=False, device="cuda")  # fmt: skip
    llm = LLM(tiny_llama, dtype="float32", **kwargs)
    prompts = _prompts(3)
    quantized = [_result(o) for o in llm.generate(prompts, PARAMS)]
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 4 and all(m.use_triton for m in layers)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantizedLinear):
                dense = Linear(child.in_features, child.out_features, bias=child.bias is not None)
                dense = dense.to("cuda").requires_grad_(False)
                dense.weight.data = child.dequantize(torch.float32)
                if child.bias is not None:
                    dense.bias.data = child.bias.data
                setattr(parent, name, dense)
    dense_results = [_result(o) for o in llm.generate(prompts, PARAMS)]
    for (tokens, lps), (dense_tokens, dense_lps) in zip(quantized, dense_results, strict=True):
        assert tokens == dense_tokens
        for (lp, _), (dense_lp, _) in zip(lps, dense_lps, strict=True):
            assert lp == pytest.approx(dense_lp, abs=1e-3)
    del llm
    eager = LLM(tiny_llama, dtype="bfloat16", enforce_eager=True, **kwargs)
    expected = [_result(o) for o in eager.generate(prompts, PARAMS)]
    del eager
    graphs = LLM(tiny_llama, dtype="bfloat16", enforce_eager=False, **kwargs)
    replayed = [_result(o) for o in graphs.generate(prompts, PARAMS)]
    for (tokens, lps), (eager_tokens, eager_lps) in zip(replayed, expected, strict=True):
        assert tokens == eager_tokens
        for (lp, _), (eager_lp, _) in zip(lps, eager_lps, strict=True):
            # one bf16 ulp of a logit near 8 is 1/16: on the H200 the two differed by 0.06
            assert lp == pytest.approx(eager_lp, abs=0.15)
