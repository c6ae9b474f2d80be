"""Attention over the paged KV cache: metadata for a flat mixed batch and the torch
reference implementation.

A step's tokens are laid out flat, request after request. Request i contributes
`query_lens[i]` tokens starting at `query_start_loc[i]`; after this step it holds
`seq_lens[i]` tokens of KV, the last `query_lens[i]` of which are the new ones. Its KV
lives in the blocks listed in row i of `block_tables`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: (
        torch.Tensor
    )  # [T] long: flat cache slot (block_id * block_size + offset) per token
    query_start_loc: list[int]  # [B + 1] host ints
    seq_lens: list[int]  # [B] host ints: tokens of KV after this step
    block_tables: torch.Tensor  # [B, max_blocks] long (padded with 0)
    # Requests with one query token whose KV fits the decode path, batched together.
    decode_indices: torch.Tensor  # [Bd] long: rows of block_tables
    decode_token_indices: torch.Tensor  # [Bd] long: their positions in the flat batch
    decode_seq_lens: torch.Tensor  # [Bd] long
    decode_max_blocks: int
    prefill_indices: list[int]  # the other requests, handled one by one

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_ids: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        num_reqs = len(query_lens)
        max_blocks = max((len(b) for b in block_ids), default=1) or 1
        table = torch.zeros((num_reqs, max_blocks), dtype=torch.long)
        slots: list[int] = []
        starts = [0]
        for i, (q_len, s_len, blocks) in enumerate(
            zip(query_lens, seq_lens, block_ids, strict=True)
        ):
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
            for pos in range(s_len - q_len, s_len):
                slots.append(blocks[pos // block_size] * block_size + pos % block_size)
            starts.append(starts[-1] + q_len)
        decode = [i for i in range(num_reqs) if query_lens[i] == 1]
        prefill = [i for i in range(num_reqs) if query_lens[i] != 1]
        decode_max_blocks = max((-(-seq_lens[i] // block_size) for i in decode), default=1)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_tables=table.to(device),
            decode_indices=torch.tensor(decode, dtype=torch.long, device=device),
            decode_token_indices=torch.tensor(
                [starts[i] for i in decode], dtype=torch.long, device=device
            ),
            decode_seq_lens=torch.tensor(
                [seq_lens[i] for i in decode], dtype=torch.long, device=device
            ),
            decode_max_blocks=decode_max_blocks,
            prefill_indices=prefill,
        )


def write_kv_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new K/V at their slots. kv_cache: [2, num_blocks, block_size, Hkv, D]; key/value: [T, Hkv, D]."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over all its KV (cached prefix + new).

    query: [T, H, D], key/value: [T, Hkv, D] (this step's, already written to the cache)
    -> out [T, H, D]."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    key_cache, value_cache = kv_cache[0], kv_cache[1]

    if meta.decode_indices.numel():
        nb = meta.decode_max_blocks
        tables = meta.block_tables[meta.decode_indices, :nb]  # [Bd, nb]
        bd = tables.shape[0]
        keys = key_cache[tables].view(bd, nb * block_size, num_kv_heads, head_dim).transpose(1, 2)
        values = (
            value_cache[tables].view(bd, nb * block_size, num_kv_heads, head_dim).transpose(1, 2)
        )
        mask = torch.arange(nb * block_size, device=query.device) < meta.decode_seq_lens[:, None]
        # The G query heads sharing a KV head play the role of a query sequence: no repeat of K/V.
        q = query[meta.decode_token_indices].view(bd, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask[:, None, None, :], scale=scale
        )  # [Bd, Hkv, G, D]
        out[meta.decode_token_indices] = o.reshape(bd, num_heads, head_dim)

    for i in meta.prefill_indices:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        q_len, s_len = end - start, meta.seq_lens[i]
        if q_len == s_len:  # no cached context: attend to this step's K/V directly
            keys, values = key[start:end], value[start:end]
        else:
            nb = -(-s_len // block_size)
            blocks = meta.block_tables[i, :nb]
            keys = key_cache[blocks].view(nb * block_size, num_kv_heads, head_dim)[:s_len]
            values = value_cache[blocks].view(nb * block_size, num_kv_heads, head_dim)[:s_len]
        q = query[start:end].transpose(0, 1)  # [H, q_len, D]
        k = keys.transpose(0, 1)  # [Hkv, s_len, D]
        v = values.transpose(0, 1)
        if group > 1:
            k = k.repeat_interleave(group, dim=0)
            v = v.repeat_interleave(group, dim=0)
        if q_len == s_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            q_pos = torch.arange(s_len - q_len, s_len, device=query.device)
            mask = torch.arange(s_len, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out
