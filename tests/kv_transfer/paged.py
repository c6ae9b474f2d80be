"""Small paged caches and their layouts for the KV-transfer tests."""

from __future__ import annotations

import torch

from duet.kv_transfer import KVLayout


def caches(heads=4, num_blocks=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, 4, heads, 8, generator=g).to(dtype) for _ in range(3)]


def layout(kv, total_heads=4, tp_size=1, tp_rank=0, model_id="m"):
    return KVLayout.of_caches(model_id, kv, total_heads, tp_size, tp_rank)


def draft_caches(num_blocks=16, seed=10, dtype=torch.float32):
    """A draft model's caches beside `caches`: 2 layers of 2 heads of 16 (the target's: 3 of 4
    of 8), the same block size."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, 4, 2, 16, generator=g).to(dtype) for _ in range(2)]


def draft_layout(kv, draft, model_id="m", draft_id="d"):
    return layout(kv, model_id=model_id).with_draft(draft_id, draft)
