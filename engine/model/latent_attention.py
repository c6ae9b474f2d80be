"""Attention over the paged cache of a multi-head latent attention model (DeepSeek-V2/V3), in
the absorbed form: Triton's latent kernel (engine/kernels/triton_mla.py) or the C++ CPU kernels
where the runner chose them, else the torch reference.

The cache of a layer is one plane, `[1, num_blocks, block_size, 1, kv_lora_rank + rope_dim]`:
per token the normalised latent c and the roped key part k_pe, which every head shares. A
head's query arrives already multiplied into latent space (q_nope times kv_b_proj's key part,
engine/model/mla.py), so its score against a token is q_abs . c + q_pe . k_pe: one dot product
with the whole entry, as if the entry were the one KV head of multi-query attention. The value
is the latent itself; the caller multiplies the result by kv_b_proj's value part.

Prefill chunks and decodes take the same path (no expanded K/V), so a token's result is
computed the same way whichever step it is in. Each result is invariant to the batch by
construction, whatever the device's BLAS does (docs/determinism.md):
- dot products over the entry and sums over keys are elementwise products and adds in a fixed
  order that depends only on the sizes involved: a halving tree over the entry
  (`_tree_sum`); over keys, a halving tree within each block, the blocks' sums added in
  position order from position 0 (`_key_sum`), so keys a row does not see, masked to zero,
  add exact zeros and the row's bits do not depend on how many keys its step holds;
- exp runs element by element (`row_invariant.elementwise`);
- everything in fp32, rounded to the model's dtype once at the end.

Memory: the products are materialised, bounded by `_MAX_ELEMENTS` per piece. A reference for
correctness and determinism, not for speed.

On the CPU backend (`resolve_attention_backend`: fp32 or bf16, an entry width the kernels
take, DeepSeek's 576 among them) the dense paged kernels run it instead: the entry plane is
the one KV head's keys and, read again, its values, so every head attends as in multi-query
attention and the first `value_size` values of each output row are the latent result (the
roped tail's 64 of 576 are computed and dropped). Decode and prefill rows follow one order
(engine/kernels/attention_order.h), so the batch invariance above holds there too, in that
order, not the reference's.
"""

from __future__ import annotations

import torch

from duet.engine.attention_metadata import AttentionMetadata
from duet.engine.kernels.cpu import paged_decode_attention, paged_prefill_attention
from duet.engine.model.row_invariant import elementwise

_MAX_ELEMENTS = 1 << 24
"""Largest elementwise product materialised at once (64 MiB of fp32)."""


def write_latent_cache(
    cache: torch.Tensor, entries: torch.Tensor, slots: torch.Tensor, triton: bool = False
) -> None:
    """Store this step's entries ([T, width]) at their slots of `cache`
    ([1, num_blocks, block_size, 1, width]). On the Triton backend (`triton`) one kernel that
    skips a slot of -1, which a CUDA graph's padding rows carry (engine/cuda_graphs.py)."""
    if triton:
        from duet.engine.kernels.triton_cache import write_cache_plane

        write_cache_plane(cache[0], entries[:, None, :], slots)
        return
    flat = cache.view(-1, cache.shape[-1])  # [num_blocks * block_size, width]
    flat.index_copy_(0, slots, entries if entries.dtype == cache.dtype else entries.to(cache.dtype))


def latent_attention(
    query: torch.Tensor,  # [T, H, width]: q_abs | q_pe
    cache: torch.Tensor,  # [1, num_blocks, block_size, 1, width], this step's entries written
    meta: AttentionMetadata,
    scale: float,
    value_size: int,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over all its entries (cached prefix and
    new): [T, H, value_size], the softmax-weighted sum of the entries' first `value_size`
    values (the latent), in `query`'s dtype. Reads the CPU kernels' batches where the runner
    built them, else `meta.block_ids` (the torch backend's)."""
    if meta.kernel_batch is not None:  # the Triton backend
        from duet.engine.kernels.triton_mla import mla_attention

        kb = meta.kernel_batch
        out = query.new_empty(query.shape[0], query.shape[1], value_size)
        max_query_len = max(kb.max_query_len, 1 if kb.decode_indices.shape[0] else 0)
        mla_attention(
            out, query, cache, kb.query_start_loc, kb.seq_lens, kb.block_tables, max_query_len,
            scale,
        )  # fmt: skip
        return out
    if meta.decode_batch is not None or meta.prefill_batch is not None:
        return _kernel_attention(query, cache, meta, scale, value_size)
    _, _, block_size, _, width = cache.shape
    plane = cache[0, :, :, 0]  # [num_blocks, block_size, width]
    num_tokens, num_heads, _ = query.shape
    out = query.new_empty(num_tokens, num_heads, value_size)
    for i in range(meta.num_reqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len = meta.seq_lens[i]
        num_blocks = -(-seq_len // block_size)
        ids = torch.tensor(meta.block_ids[i][:num_blocks], device=query.device)
        entries = plane.index_select(0, ids).view(num_blocks * block_size, width).float()
        positions = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        out[start:end] = _attend(
            query[start:end].float(), entries, positions, scale, value_size, block_size
        ).to(out.dtype)
    return out


def _kernel_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    value_size: int,
) -> torch.Tensor:
    """The C++ kernels over the entry plane read as keys and as values: [T, H, value_size], a
    view of their [T, H, width] output. Every row is a decode or a kernel prefill row (the
    runner picks this backend only where the prefill kernel takes the width)."""
    assert len(meta.prefill_indices) == 0 or meta.prefill_batch is not None
    plane = cache[0]  # [num_blocks, block_size, 1, width]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    d = meta.decode_batch
    if d is not None and d.token_indices.shape[0] >= torch.get_num_threads():
        # Every head of a sequence shares its one KV head, so the prefill kernel's tiling (an
        # fp32 panel of the entries, 12 heads at a time) pays for decode rows too once each
        # thread has a sequence: 1.4-2x the decode kernel's speed at 128 heads, 2 threads.
        # The decode kernel splits one long sequence over threads. Same order, same bits.
        ones = torch.ones_like(d.seq_lens)
        paged_prefill_attention(
            out, query, plane, plane, d.block_tables, d.seq_lens, d.token_indices, ones, scale
        )
    elif d is not None:
        paged_decode_attention(
            out, query, plane, plane, d.block_tables, d.seq_lens, d.token_indices, scale
        )
    p = meta.prefill_batch
    if p is not None:
        paged_prefill_attention(
            out,
            query,
            plane,
            plane,
            p.block_tables,
            p.seq_lens,
            p.query_start,
            p.query_lens,
            scale,
        )
    return out[..., :value_size]


def _attend(
    q: torch.Tensor,  # [L, H, width] fp32
    entries: torch.Tensor,  # [S, width] fp32, S a whole number of blocks
    positions: torch.Tensor,  # [L]: each query row's position (it sees keys 0..position)
    scale: float,
    value_size: int,
    block_size: int,
) -> torch.Tensor:  # [L, H, value_size] fp32
    num_rows, num_heads, width = q.shape
    num_keys = entries.shape[0]
    rows = q.reshape(num_rows * num_heads, width)
    row_positions = positions.repeat_interleave(num_heads)  # [L H]
    values = entries[:, :value_size]
    out = rows.new_empty(rows.shape[0], value_size)
    step = max(1, _MAX_ELEMENTS // (num_keys * max(width, value_size)))
    keys = torch.arange(num_keys, device=q.device)
    for lo in range(0, rows.shape[0], step):
        part = rows[lo : lo + step]  # [R, width]
        scores = _tree_sum(part[:, None, :] * entries[None]) * scale  # [R, S]
        hidden = keys[None, :] > row_positions[lo : lo + step, None]
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = elementwise(torch.exp, scores - scores.amax(dim=-1, keepdim=True))  # [R, S]
        total = _key_sum(probs, block_size)  # [R]
        weighted = _key_sum(probs[:, None, :] * values.t()[None], block_size)  # [R, value_size]
        out[lo : lo + step] = weighted / total[:, None]
    return out.view(num_rows, num_heads, value_size)


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension in one order that depends only on its size: halves
    added while the size is even, then the rest one by one."""
    n = x.shape[-1]
    while n > 1 and n % 2 == 0:
        n //= 2
        x = x[..., :n] + x[..., n:]
    total = x[..., 0]
    for j in range(1, n):
        total = total + x[..., j]
    return total


def _key_sum(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """The sum over the last dimension (keys, a whole number of blocks): `_tree_sum` within
    each block, then the blocks in position order from the first."""
    blocks = x.unflatten(-1, (x.shape[-1] // block_size, block_size))
    sums = _tree_sum(blocks)  # [..., num_blocks]
    total = sums[..., 0]
    for b in range(1, sums.shape[-1]):
        total = total + sums[..., b]
    return total
