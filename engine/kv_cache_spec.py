"""`KVCacheSpec`: what one layer's paged KV cache holds per token on one rank, the single
source of the cache's shape and size for the model runner, KV sizing, `duet plan` and the KV
transfer layouts.

Two layouts:
- dense attention: K and V, `[2, num_blocks, block_size, num_kv_heads, head_dim]`;
- multi-head latent attention (DeepSeek-V2/V3): one compressed entry per token, the
  normalised latent and the roped key part every head shares,
  `[1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]` (576 values for
  DeepSeek-V3, where its 128 heads would cache 128 x (192 + 128) = 40,960 as K and V).
  Kept five-dimensional, one plane of one "head", so that block-wise code (gathers, scatters,
  transfers) reads both layouts the same way: planes x blocks x [block_size, heads, width].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from duet.engine.model.arch import ModelArchConfig

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class KVCacheSpec:
    num_planes: int
    """2: K and V; 1: MLA's compressed entry."""
    num_kv_heads: int
    """Heads this rank caches per plane (MLA: 1)."""
    head_dim: int
    """Values per head and token (MLA: kv_lora_rank + qk_rope_head_dim)."""

    @property
    def is_latent(self) -> bool:
        """Whether this is MLA's one-plane latent layout."""
        return self.num_planes == 1

    @property
    def latent_width(self) -> int | None:
        """MLA's entry width (the attention kernels' head size for it); None when dense."""
        return self.head_dim if self.is_latent else None

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        """One layer's cache tensor."""
        return (self.num_planes, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def values_per_token(self) -> int:
        """Values one token takes in one layer."""
        return self.num_planes * self.num_kv_heads * self.head_dim

    def bytes_per_block(self, num_layers: int, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over `num_layers` layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * block_size * self.values_per_token() * itemsize

    def max_addressable_blocks(self, block_size: int) -> int:
        """Most blocks one layer's cache may hold so that the offset of each of its elements
        fits a signed 32-bit integer (the Triton kernels compute `block id * block stride` in
        int32)."""
        return INT32_MAX // (block_size * self.values_per_token())


def kv_cache_spec(arch: ModelArchConfig, num_kv_heads: int) -> KVCacheSpec:
    """The cache layout of `arch` on a rank caching `num_kv_heads` KV heads (ignored for MLA,
    whose entry is not split over ranks)."""
    if arch.mla is not None:
        return KVCacheSpec(1, 1, arch.mla.entry_size)
    return KVCacheSpec(2, num_kv_heads, arch.head_dim)
