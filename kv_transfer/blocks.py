"""Gathering a request's blocks out of the paged cache and scattering them into another, as
one tensor op per layer (never a Python loop over blocks)."""

from __future__ import annotations

import torch

from duet.engine.kernels.cpu import load_cpu_kernels


def gather_blocks(
    kv_caches: list[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """kv_caches: per layer [2, NB, BS, Hkv, D]; block_ids: [n] long
    -> [L, 2, n, BS, Hkv, D] contiguous, written into `out` when given (a staging buffer)."""
    first = kv_caches[0]
    if out is None:
        out = torch.empty(
            (len(kv_caches), 2, block_ids.numel(), *first.shape[2:]),
            dtype=first.dtype,
            device=first.device,
        )
    for layer, cache in enumerate(kv_caches):
        torch.index_select(_as_words(cache), 1, block_ids, out=_as_words(out[layer]))
    return out


def scatter_blocks(
    kv_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    blocks: torch.Tensor,
    head_range: tuple[int, int] | None = None,
) -> None:
    """Write `blocks` ([L, 2, n, BS, h, D]) into the caches at `block_ids`. With `head_range`
    the blocks hold only KV heads [start, end) of the receiver's heads (a shard from a sender
    with another tensor-parallel layout: `layout.head_route`)."""
    if head_range is None and _scatter_rows(kv_caches, block_ids, blocks):
        return
    for layer, cache in enumerate(kv_caches):
        if head_range is not None:
            start, end = head_range
            cache = cache[:, :, :, start:end]
        _as_words(cache).index_copy_(1, block_ids, _as_words(blocks[layer]))


def _scatter_rows(
    kv_caches: list[torch.Tensor], block_ids: torch.Tensor, blocks: torch.Tensor
) -> bool:
    """The CPU fast path of scatter_blocks: each block's K and V are one contiguous row of the
    cache, copied by the C++ kernel's memcpy (2.5x index_copy_'s speed). False when it does not
    apply (GPU, a non-contiguous cache, kernels off): the caller takes the torch path."""
    first = kv_caches[0]
    if first.device.type != "cpu" or not blocks.is_contiguous():
        return False
    if not all(cache.is_contiguous() for cache in kv_caches):
        return False
    kernels = load_cpu_kernels()
    if kernels is None:
        return False
    num_blocks, n = first.shape[1], block_ids.numel()
    # K rows are 0..NB-1 of the [2 * NB, row] view, V rows NB..2NB-1
    dst_rows = torch.cat([block_ids, block_ids + num_blocks]).to(torch.long)
    src_rows = torch.arange(2 * n, dtype=torch.long)
    for layer, cache in enumerate(kv_caches):
        kernels.copy_rows(
            cache.view(2 * num_blocks, -1), dst_rows, blocks[layer].view(2 * n, -1), src_rows
        )
    return True


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """A 2-byte-element tensor (bf16, fp16) viewed as int32 pairs: the same bits, and CPU
    `index_copy_` moves 4-byte elements ~1.5x faster per byte (measured on a 2-core EPYC VM;
    `index_select` ~7% faster on a 2-core Xeon)."""
    if t.element_size() == 2 and t.shape[-1] % 2 == 0 and t.stride(-1) == 1:
        return t.view(torch.int32)
    return t
