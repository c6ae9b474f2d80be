"""Attention over the paged KV cache: the torch reference implementation, and the dispatch
to the CPU and Triton kernels (the metadata they read: attention_metadata.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from duet.engine.attention_metadata import AttentionMetadata
from duet.engine.kernels.cpu import (
    kernels_for,
    load_cpu_kernels,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_kernel_supports,
)


def write_kv_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new K/V at their slots. kv_cache: [2, num_blocks, block_size, Hkv, D]; key/value: [T, Hkv, D]."""
    dtype = kv_cache.dtype
    if key.dtype == dtype and value.dtype == dtype:
        kernels = kernels_for(kv_cache)
        if kernels is not None:  # one memcpy per row; index_copy_ ran at ~4 GB/s in prefill
            kernels.write_kv(kv_cache, key, value, slot_mapping)
            return
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    # no `.to` when it would be a no-op: two calls a layer at batch 1
    flat[0].index_copy_(0, slot_mapping, key if key.dtype == dtype else key.to(dtype))
    flat[1].index_copy_(0, slot_mapping, value if value.dtype == dtype else value.to(dtype))


def store_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Write this step's K/V to their slots: one Triton kernel on that backend, else
    `write_kv_cache`."""
    if meta.kernel_batch is not None:
        from duet.engine.kernels.triton_cache import write_kv_cache as triton_write_kv_cache

        triton_write_kv_cache(kv_cache, key, value, meta.slot_mapping)
    else:
        write_kv_cache(kv_cache, key, value, meta.slot_mapping)


def decode_only_kernels(meta: AttentionMetadata, device: torch.device) -> Any | None:
    """The CPU kernels when every token of the step is a decode on the C++ decode kernel (no
    prefill, no torch-path group, not Triton), else None."""
    if meta.decode_batch is None or meta.decode_groups or meta.prefill_indices:
        return None
    if meta.kernel_batch is not None or device.type != "cpu":
        return None
    return load_cpu_kernels()


class GatherWorkspace:
    """Grow-only buffers that gathered K/V blocks are copied into, reused every layer and step
    (fresh multi-MB tensors per layer cost page faults on the CPU)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[int, torch.dtype, torch.device, tuple[int, ...]], torch.Tensor] = {}

    def gather(self, which: int, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """cache: [num_blocks, block_size, Hkv, D] -> [len(block_ids), block_size, Hkv, D]."""
        n = block_ids.shape[0]
        key = (which, cache.dtype, cache.device, tuple(cache.shape[1:]))
        buf = self._bufs.get(key)
        if buf is None or buf.shape[0] < n:
            buf = torch.empty(
                (max(n, 64), *cache.shape[1:]), dtype=cache.dtype, device=cache.device
            )
            self._bufs[key] = buf
        return torch.index_select(cache, 0, block_ids, out=buf[:n])


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    workspace: GatherWorkspace,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over all its KV (cached prefix + new).

    query: [T, H, D], key/value: [T, Hkv, D] (this step's, already written to the cache)
    -> out [T, H, D]."""
    if meta.kernel_batch is not None:
        return _triton_attention(query, key, value, kv_cache, meta, scale)
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    # [T, H, D] contiguous: a view of q|k|v is strided, and is not dense, so empty_like packs
    out = torch.empty_like(query)
    key_cache, value_cache = kv_cache.unbind(0)
    # NOTE: the CPU kernels read the query where it is (a view of q|k|v: each token's heads
    # contiguous, tokens at the projection's stride), with no copy.
    on_kernels = meta.decode_batch is not None or meta.prefill_batch is not None

    if meta.decode_batch is not None:
        d = meta.decode_batch
        paged_decode_attention(
            out,
            query,
            key_cache,
            value_cache,
            d.block_tables,
            d.seq_lens,
            d.token_indices,
            scale,
        )

    for g in meta.decode_groups:
        bd, length = g.token_indices.shape[0], g.num_blocks * block_size
        keys = workspace.gather(0, key_cache, g.block_ids).view(bd, length, num_kv_heads, head_dim)
        values = workspace.gather(1, value_cache, g.block_ids).view(
            bd, length, num_kv_heads, head_dim
        )
        mask = torch.arange(length, device=query.device) < g.seq_lens[:, None]
        # The G query heads sharing a KV head play the role of a query sequence: no repeat of K/V.
        q = query[g.token_indices].view(bd, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(
            q,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=scale,
        )  # [Bd, Hkv, G, D]
        out[g.token_indices] = o.reshape(bd, num_heads, head_dim)

    p = meta.prefill_batch
    if p is not None:
        if prefill_kernel_supports(head_dim):
            paged_prefill_attention(
                out,
                query,
                key_cache,
                value_cache,
                p.block_tables,
                p.seq_lens,
                p.query_start,
                p.query_lens,
                scale,
            )
            return out

    if on_kernels and meta.prefill_indices:
        query = query.contiguous()  # the torch path beside the kernels, as it has always read
    for i in meta.prefill_indices:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        q_len, s_len = end - start, meta.seq_lens[i]
        if q_len == s_len:  # no cached context: attend to this step's K/V directly
            keys, values = key[start:end], value[start:end]
        else:
            nb = -(-s_len // block_size)
            ids = torch.tensor(meta.block_ids[i][:nb], device=query.device)
            keys = workspace.gather(0, key_cache, ids).view(
                nb * block_size, num_kv_heads, head_dim
            )[:s_len]
            values = workspace.gather(1, value_cache, ids).view(
                nb * block_size, num_kv_heads, head_dim
            )[:s_len]
        # NOTE: 4-D ([1, heads, len, D]), not 3-D: on the CPU only 4-D inputs reach SDPA's
        # flash kernel (GQA included); 3-D ones take the unfused math path, 2-3x slower.
        q = query[start:end].transpose(0, 1)[None]  # [1, H, q_len, D]
        k = keys.transpose(0, 1)[None]  # [1, Hkv, s_len, D]
        v = values.transpose(0, 1)[None]
        if q_len == s_len:
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        else:
            q_pos = torch.arange(s_len - q_len, s_len, device=query.device)
            mask = torch.arange(s_len, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1
            )
        out[start:end] = o[0].transpose(0, 1)
    return out


def _whole_prompts_in_sdpa(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> None:
    """Each prompt's causal attention over its own K/V (whole prompts, no cached prefix) in
    torch's SDPA (FlashAttention on a GPU), into its rows of `out`."""
    gqa = query.shape[1] != key.shape[1]
    for i in meta.prefill_indices:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        o = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1)[None], key[start:end].transpose(0, 1)[None],
            value[start:end].transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=gqa,
        )  # fmt: skip
        out[start:end] = o[0].transpose(0, 1)


def _triton_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Decodes through the split-K decode kernel, the rest through the prefill kernel; both
    read K/V from the cache, where `store_kv` has put this step's. A step of whole prompts
    with `prefill_attention` sdpa (`KernelBatch.whole_prompts_in_sdpa`) runs its prompts in
    SDPA on this step's K/V instead of the prefill kernel."""
    from duet.engine.kernels.triton_decode import paged_decode_attention
    from duet.engine.kernels.triton_prefill import paged_prefill_attention

    batch = meta.kernel_batch
    assert batch is not None
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, H, D]
    common = (kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables)
    paged_decode_attention(
        out, query, *common, batch.decode_indices, scale, batch.num_splits, batch.split_partition
    )
    if batch.whole_prompts_in_sdpa:
        _whole_prompts_in_sdpa(out, query, key, value, meta, scale)
    else:
        paged_prefill_attention(
            out, query, *common, batch.prefill_indices, batch.max_query_len, scale
        )
    return out
