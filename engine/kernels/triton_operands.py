"""What the Triton attention kernels ask of their operands: the cache layout they index with
32-bit offsets, and the operand dtype of their `tl.dot`s. Shared by `triton_decode` and
`triton_prefill`; `triton_runtime` imports those kernel modules, so this lives apart from it."""

from __future__ import annotations

from typing import Any

import torch


def check_cache_layout(kv_cache: torch.Tensor) -> None:
    """The attention kernels index one half of the cache (K or V) with 32-bit offsets."""
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous [2, num_blocks, block_size, Hkv, D]")
    if kv_cache[0].numel() >= 2**31:
        raise ValueError(
            f"kv_cache: one layer's K holds {kv_cache[0].numel()} elements; the Triton kernels "
            "address at most 2**31 - 1 (use fewer num_kv_blocks per layer)"
        )


def operand_dtype(dtype: torch.dtype) -> Any:
    """What the attention kernels round their `tl.dot` operands to (the probabilities included):
    the cache's dtype, on GPUs and in the interpreter alike."""
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[
        dtype
    ]


def dot_dtype(dtype: torch.dtype, device: torch.device) -> Any:
    """Type the attention kernels' `tl.dot`s multiply in: the cache's dtype on GPUs; fp32 in
    the interpreter, whose `tl.dot` multiplies the raw bits of 16-bit floats (triton 3.7, errors
    of 1e10). There the operands are still rounded to `operand_dtype` first, so the interpreter
    emulates a 16-bit kernel's numerics with exact fp32 products of 16-bit values."""
    import triton.language as tl

    if device.type != "cuda":
        return tl.float32
    return operand_dtype(dtype)
