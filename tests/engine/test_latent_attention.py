"""Multi-head latent attention on the C++ CPU kernels (engine/model/latent_attention.py): the
entry plane read as the one KV head's keys and values gives the torch reference's result, and
the same bits whichever kernel takes the decode rows (the prefill kernel once every thread has
a sequence, else the decode kernel)."""

from __future__ import annotations

import pytest
import torch

from duet.engine.attention_metadata import AttentionMetadata
from duet.engine.kernels.cpu import load_cpu_kernels
from duet.engine.model.latent_attention import latent_attention

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="the C++ kernels did not build")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [64, 576])
def test_kernels_equal_the_reference_and_each_other(dtype, width):
    """Three decodes (contexts 5, 300 and 513) and two prefill rows groups (a whole 20-token
    prompt, a 9-token chunk after 250 cached tokens) in one step, 8 heads."""
    block_size, heads, latent = 16, 8, width - width // 9
    query_lens, seq_lens = [1, 20, 1, 9, 1], [5, 20, 300, 259, 513]
    g = torch.Generator().manual_seed(width)
    per = [-(-s // block_size) for s in seq_lens]
    order = torch.randperm(sum(per) + 4, generator=g).tolist()
    tables, at = [], 0
    for n in per:
        tables.append(order[at : at + n])
        at += n
    cache = torch.randn(1, len(order), block_size, 1, width, generator=g).to(dtype)
    query = torch.randn(sum(query_lens), heads, width, generator=g).to(dtype)
    scale = 0.1
    cpu = torch.device("cpu")
    kernel = AttentionMetadata.build(
        query_lens, seq_lens, tables, block_size, cpu, use_decode_kernel=True
    )
    reference = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, cpu)
    assert kernel.decode_batch is not None and kernel.prefill_batch is not None
    want = latent_attention(query, cache, reference, scale, latent)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (2, 4):  # 3 decodes: the prefill kernel at 2 threads, decode at 4
            torch.set_num_threads(threads)
            results.append(latent_attention(query, cache, kernel, scale, latent))
    finally:
        torch.set_num_threads(before)
    assert results[0].shape == (sum(query_lens), heads, latent)
    assert torch.equal(results[0], results[1])
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-6
    torch.testing.assert_close(results[0].float(), want.float(), atol=tol, rtol=tol)
