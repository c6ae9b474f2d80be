"""Paged attention: the fused CPU decode kernel and the grouped torch path against a plain
per-request reference, on random caches with scattered block tables."""

from __future__ import annotations

import pytest
import torch

from duet.engine.attention import GatherWorkspace, paged_attention, write_kv_cache
from duet.engine.attention_metadata import AttentionMetadata
from duet.engine.kernels.cpu import load_cpu_kernels


def reference(query, kv_cache, query_lens, seq_lens, block_ids, scale):
    """Per request: gather its KV in order, causal attention for its new tokens."""
    hkv, d = kv_cache.shape[3], kv_cache.shape[4]
    group = query.shape[1] // hkv
    outs, start = [], 0
    for q_len, s_len, blocks in zip(query_lens, seq_lens, block_ids, strict=True):
        k = kv_cache[0][blocks].reshape(-1, hkv, d)[:s_len].float()
        v = kv_cache[1][blocks].reshape(-1, hkv, d)[:s_len].float()
        q = query[start : start + q_len].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        pos = torch.arange(s_len - q_len, s_len)
        mask = torch.arange(s_len)[None, :] <= pos[:, None]
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += q_len
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_mixed_batch_matches_reference(dtype, use_kernel):
    if use_kernel and load_cpu_kernels() is None:
        pytest.fail("the C++ CPU kernel did not build (g++ and ninja are project dependencies)")
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, hkv, heads, d = 64, 4, 2, 6, 16
    kv_cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(dtype)
    # decodes of varied lengths, a fresh prefill, and a prefill chunk over cached context
    query_lens = [1, 1, 5, 1, 3, 1]
    seq_lens = [1, 17, 5, 40, 11, 9]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    block_ids, used = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        block_ids.append(perm[used : used + n])
        used += n
    total = sum(query_lens)
    query = torch.randn(total, heads, d, generator=g).to(dtype)
    key = torch.randn(total, hkv, d, generator=g).to(dtype)
    value = torch.randn(total, hkv, d, generator=g).to(dtype)
    meta = AttentionMetadata.build(
        query_lens, seq_lens, block_ids, block_size, torch.device("cpu"), use_kernel
    )
    write_kv_cache(kv_cache, key, value, meta.slot_mapping)
    assert (meta.decode_batch is not None) == use_kernel
    out = paged_attention(query, key, value, kv_cache, meta, d**-0.5, GatherWorkspace())
    ref = reference(query, kv_cache, query_lens, seq_lens, block_ids, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_decode_groups_bound_padding():
    # lengths 160, 150, 20, 18 (block 16): the long and short ones land in separate groups
    meta = AttentionMetadata.build(
        [1, 1, 1, 1],
        [160, 20, 150, 18],
        [[0] * 10, [1, 2], [3] * 10, [4, 5]],
        16,
        torch.device("cpu"),
    )
    assert [g.num_blocks for g in meta.decode_groups] == [10, 2]
    assert [g.token_indices.tolist() for g in meta.decode_groups] == [[0, 2], [1, 3]]
