"""Writing a step's new K/V into the paged cache, by slot, in one Triton kernel; or one
plane's rows (`write_cache_plane`: MLA's latent cache).

Reference: `engine.attention.write_kv_cache` (two `index_copy_`). A slot of -1 is skipped:
padded rows of a CUDA-graph batch carry it, so they write nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import next_power_of_2


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_VALUE: tl.constexpr = True,
):
    # One program per token: all its heads at once ([BLOCK_H, BLOCK_D] tile).
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim) & (slot >= 0)
    block = slot // block_size
    offset = slot % block_size
    src_k = key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(src_k, mask=mask)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    if WRITE_VALUE:
        v = tl.load(src_v, mask=mask)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kv_cache: [2, num_blocks, block_size, Hkv, D]; key/value: [T, Hkv, D] (last dim
    contiguous, other strides free); slot_mapping: [T] int, block_id * block_size + offset,
    or -1 to skip the token."""
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous [2, num_blocks, block_size, Hkv, D]")
    if key.shape[0] == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _launch(kv_cache[0], kv_cache[1], key, value, slot_mapping)


def write_cache_plane(plane: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """One plane's rows: plane [num_blocks, block_size, H, D] (contiguous), rows [T, H, D] (last
    dim contiguous), slot_mapping [T] (-1: skip the row). MLA's latent cache is one such plane
    (engine/model/latent_attention.py)."""
    if not plane.is_contiguous():
        raise ValueError("plane must be contiguous [num_blocks, block_size, H, D]")
    if rows.shape[0] == 0:
        return
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    _launch(plane, None, rows, None, slot_mapping)


def _launch(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,  # None: one plane (key_cache) only
    key: torch.Tensor,
    value: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> None:
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    write_value = value_cache is not None and value is not None
    # one plane: the value arguments repeat the key's, and the kernel never reads them
    second = (key_cache, key) if value_cache is None or value is None else (value_cache, value)
    _write_kv_kernel[(key.shape[0],)](
        key,
        second[1],
        key_cache,
        second[0],
        slot_mapping,
        key.stride(0),
        key.stride(1),
        second[1].stride(0),
        second[1].stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_kv_heads,
        head_dim,
        block_size,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        WRITE_VALUE=write_value,
        num_warps=4,
    )
