"""The Triton latent attention kernel (engine/kernels/triton_mla.py) at DeepSeek's entry width
(512 latent + 64 roped values): it matches the torch reference, and a row's result has the same
bits in any batch, chunked or whole, as a decode step. Interpreted without CUDA (fp32; bf16
through the kernels' 16-bit emulation), compiled with it."""

from __future__ import annotations

import platform
import sys

import pytest
import torch

from duet.engine.attention_metadata import AttentionMetadata, KernelBatch
from duet.engine.model.latent_attention import latent_attention
from tests.engine.triton_cases import (
    BF16_TOL,
    DEVICE,
    FP32_TOL,
    triton_interpreter,  # noqa: F401 (autouse fixture)
)

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("triton ships wheels for Linux x86_64 only", allow_module_level=True)

LATENT, ROPE, HEADS, BLOCK = 512, 64, 20, 16  # 20 heads: a full 16-head tile and a partial one
LENGTH = 80  # three 32-entry key tiles in bf16, five 16-entry ones in fp32


def _case(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A cache holding one 80-token prompt's entries, its block ids, a query per position."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    num_blocks = -(-LENGTH // BLOCK) + 5
    cache = torch.randn(1, num_blocks, BLOCK, 1, LATENT + ROPE, generator=g, device=DEVICE)
    query = torch.randn(LENGTH, HEADS, LATENT + ROPE, generator=g, device=DEVICE)
    blocks = torch.randperm(num_blocks, generator=g, device=DEVICE)[: -(-LENGTH // BLOCK)]
    return cache.to(dtype), query.to(dtype), blocks.tolist()


def _run(
    cache: torch.Tensor, query: torch.Tensor, blocks: list[int], bounds: list[tuple[int, int]]
) -> torch.Tensor:
    """Rows [start, end) for each (start, end) in `bounds`, each its own request of one launch
    with the first `start` tokens cached (a chunk, or a decode when end = start + 1)."""
    from duet.engine.kernels.triton_mla import mla_attention

    q = torch.cat([query[a:b] for a, b in bounds]).contiguous()
    out = torch.full((q.shape[0], HEADS, LATENT), float("nan"), dtype=q.dtype, device=DEVICE)
    query_lens = [b - a for a, b in bounds]
    seq_lens = [b for _, b in bounds]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    table = torch.tensor(blocks, dtype=torch.int32, device=DEVICE).repeat(len(bounds), 1)
    mla_attention(
        out, q, cache, starts.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        table, max(query_lens), 0.06,
    )  # fmt: skip
    return out


def _reference(cache: torch.Tensor, query: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    meta = AttentionMetadata.build([LENGTH], [LENGTH], [blocks], BLOCK, DEVICE)
    return latent_attention(query, cache, meta, 0.06, LATENT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunks_decodes_and_batches_give_the_whole_prefills_bits(dtype):
    """The whole prompt in one launch; its rows again as chunks of 23 (a batch of unequal
    requests), after a 64-token prefix hit, and as decode steps at three positions in one
    batch: bitwise the same rows. The whole prefill matches the torch reference."""
    cache, query, blocks = _case(dtype)
    whole = _run(cache, query, blocks, [(0, LENGTH)])
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(whole.float(), _reference(cache, query, blocks).float(), **tol)
    chunks = [(a, min(a + 23, LENGTH)) for a in range(0, LENGTH, 23)]
    assert torch.equal(_run(cache, query, blocks, chunks), whole)
    assert torch.equal(_run(cache, query, blocks, [(64, LENGTH)]), whole[64:])
    positions = [0, 33, LENGTH - 1]
    decodes = _run(cache, query, blocks, [(p, p + 1) for p in positions])
    assert torch.equal(decodes, whole[positions])


def test_an_entry_off_the_powers_of_two():
    """The tiny test models' entry (48 latent + 16 roped values) through masked tiles: fp32
    rows equal the reference's."""
    from duet.engine.kernels.triton_mla import mla_attention

    latent, rope, length = 48, 16, 40
    g = torch.Generator(device=DEVICE).manual_seed(1)
    cache = torch.randn(1, 8, BLOCK, 1, latent + rope, generator=g, device=DEVICE)
    query = torch.randn(length, 4, latent + rope, generator=g, device=DEVICE)
    blocks = [5, 2, 7]
    meta = AttentionMetadata.build([length], [length], [blocks], BLOCK, DEVICE)
    want = latent_attention(query, cache, meta, 0.1, latent)
    kb = KernelBatch.build([length], [length], [blocks], meta_starts(length), 1, DEVICE)
    out = torch.empty(length, 4, latent, device=DEVICE)
    mla_attention(out, query, cache, kb.query_start_loc, kb.seq_lens, kb.block_tables, length, 0.1)
    torch.testing.assert_close(out, want, **FP32_TOL)


def test_a_deepseek_engine_on_the_triton_backend_gives_the_cpu_kernels_tokens(
    tiny_model_factory,
):
    """`attention_backend="triton"` (what auto picks on CUDA) for DeepSeek-V3: the runner
    takes the latent kernel, and 3 prompts' fp32 greedy tokens equal the C++ kernels' (the
    CPU's auto), top-2 logprobs within 1e-5."""
    from duet.engine import LLM, SamplingParams
    from tests.engine.test_deepseek import DEEPSEEK_SHAPES, assert_same_tokens
    from tests.engine.test_moe import _prompts

    model_dir = tiny_model_factory("deepseek_v3", **DEEPSEEK_SHAPES)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    options = dict(dtype="float32", load_progress=False, num_kv_blocks=64)
    triton = LLM(model_dir, attention_backend="triton", device=DEVICE.type, **options)
    assert triton.engine.runner.attention_backend == "triton"
    cpu = LLM(model_dir, device="cpu", **options)
    assert cpu.engine.runner.attention_backend == "cpu"
    prompts = _prompts()[:3]
    assert_same_tokens(triton.generate(prompts, params), cpu.generate(prompts, params))


def meta_starts(*lengths: int):
    import numpy as np

    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_deepseek_v3_shape_compiled_in_bf16():
    """Compiled, bf16, DeepSeek-V3's 128 heads over a 1,000-token prompt: chunks of 333 and
    decodes at three positions give the whole prefill's bits, which is close to the reference."""
    from duet.engine.kernels.triton_mla import mla_attention

    heads, length = 128, 1000
    g = torch.Generator(device="cuda").manual_seed(7)
    num_blocks = -(-length // BLOCK)
    cache = torch.randn(1, num_blocks + 3, BLOCK, 1, LATENT + ROPE, generator=g, device="cuda")
    cache = cache.to(torch.bfloat16)
    query = torch.randn(length, heads, LATENT + ROPE, generator=g, device="cuda")
    query = query.to(torch.bfloat16)
    blocks = torch.randperm(num_blocks + 3, generator=g, device="cuda")[:num_blocks].tolist()
    i32 = dict(dtype=torch.int32, device="cuda")

    def run(bounds: list[tuple[int, int]]) -> torch.Tensor:
        q = torch.cat([query[a:b] for a, b in bounds]).contiguous()
        out = torch.empty(q.shape[0], heads, LATENT, dtype=q.dtype, device="cuda")
        lens = [b - a for a, b in bounds]
        starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], **i32)
        table = torch.tensor(blocks, **i32).repeat(len(bounds), 1)
        seq_lens = torch.tensor([b for _, b in bounds], **i32)
        mla_attention(out, q, cache, starts, seq_lens, table, max(lens), 0.06)
        return out

    whole = run([(0, length)])
    assert torch.equal(run([(0, 333), (333, 666), (666, length)]), whole)
    positions = [0, 511, length - 1]
    assert torch.equal(run([(p, p + 1) for p in positions]), whole[positions])
    meta = AttentionMetadata.build([length], [length], [blocks], BLOCK, torch.device("cuda"))
    want = latent_attention(query, cache, meta, 0.06, LATENT)
    torch.testing.assert_close(whole.float(), want.float(), **BF16_TOL)
