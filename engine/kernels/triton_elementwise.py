"""A decoder layer's small operators on CUDA, one Triton kernel each: the residual add fused
with the RMSNorm that follows it, the rotary embedding of q and k together (in place; or
with the step's KV write in the same kernel, `rotary_embedding_and_store`), and SiLU(gate) * up. The same calls as the CPU kernels' (engine/kernels/cpu.py), so the model's
layers take either through `fused_ops_for` (engine/kernels/__init__.py).

Why: a decode step is a few large weight products and, per layer, a few dozen tiny operators;
torch runs RMSNorm as eight kernels (cast, square, mean, add, rsqrt, multiply, cast, scale),
the rotary embedding as about a dozen, SiLU * up as two. At batch 1 on an H100/H200 each of
those takes 2-4 us however little it does, so 32 layers x ~35 kernels cost about as much as
reading the weights (issue 41: a Llama-3.1-8B step at 50% of the HBM roofline). One kernel
per operator leaves about 8 kernels a layer.

Numerics: HF's, with each intermediate rounded where HF's torch code rounds it (the residual
sum and the normalised row to the model's dtype before the weight scales it; SiLU's output
before the product; the rotary embedding in fp32 and rounded once), and every row computed by
one program with one fixed reduction, so a row's bits do not depend on the batch
(docs/determinism.md). Checked against torch in Triton's interpreter at real shapes
(tests/engine/test_triton_elementwise.py) and compiled for sm_90 by ptxas.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from duet.engine.kernels.triton_norm import rms_norm

__all__ = [
    "fused_add_rms_norm",
    "rms_norm",
    "rotary_embedding",
    "rotary_embedding_and_store",
    "silu_and_mul",
]


@triton.jit(do_not_specialize=["eps"])
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, width, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    summed = (x + r).to(res_ptr.dtype.element_ty)  # HF: residual + hidden, in the model's dtype
    tl.store(res_ptr + row * width + cols, summed, mask=mask)
    s = summed.to(tl.float32)
    mean_square = tl.sum(s * s, 0) / width
    normed = (s * tl.math.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + row * width + cols, out, mask=mask)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """residual += x, then x = RMSNorm(residual) * weight, both in place. x, residual: [T, D]
    contiguous, one dtype; weight: [D]."""
    rows, width = x.shape
    if residual.shape != x.shape or weight.shape != (width,):
        raise ValueError(
            f"residual must be {tuple(x.shape)} and weight [{width}]; got "
            f"{tuple(residual.shape)} and {tuple(weight.shape)}"
        )
    if not (x.is_contiguous() and residual.is_contiguous()):
        raise ValueError("x and residual must be contiguous")
    if rows:
        block = triton.next_power_of_2(width)
        _add_rms_norm_kernel[(rows,)](
            x, residual, weight, width, eps, BLOCK=block, num_warps=min(16, max(1, block // 256))
        )


@triton.jit
def _rotate_heads(ptr, num_heads, cos, sin, heads, cols, half):
    """One token's `num_heads` heads at `ptr` (each [2 * half], contiguous), in place; the
    rotated halves, in `ptr`'s dtype, are returned too."""
    mask = (heads < num_heads) & (cols < half)
    first = ptr + heads * (2 * half) + cols
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    r1 = (x1 * cos - x2 * sin).to(ptr.dtype.element_ty)
    r2 = (x2 * cos + x1 * sin).to(ptr.dtype.element_ty)
    tl.store(first, r1, mask=mask)
    tl.store(first + half, r2, mask=mask)
    return r1, r2


@triton.jit
def _token_angles(pos_ptr, cos_ptr, sin_ptr, token, half, BLOCK_D: tl.constexpr):
    """The fp32 cos and sin rows [1, BLOCK_D] of `token`'s position (tables [P, half]), and
    the column indices they are laid out on."""
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)[None, :]
    cos = tl.load(cos_ptr + pos * half + cols, mask=cols < half, other=0.0)
    sin = tl.load(sin_ptr + pos * half + cols, mask=cols < half, other=0.0)
    return cols, cos, sin


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, q_stride, k_stride, num_q_heads, num_k_heads,
    half, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cols, cos, sin = _token_angles(pos_ptr, cos_ptr, sin_ptr, token, half, BLOCK_D)
    heads = tl.arange(0, BLOCK_H)[:, None]
    _rotate_heads(q_ptr + token * q_stride, num_q_heads, cos, sin, heads, cols, half)
    _rotate_heads(k_ptr + token * k_stride, num_k_heads, cos, sin, heads, cols, half)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place (HF's rotate-half layout) by the fp32
    tables cos/sin [max_position, D/2] at `positions` [T]. Each token's heads must be
    contiguous (strided tokens are fine: q and k are views of one qkv product)."""
    tokens, num_q, head_dim = q.shape
    num_k = k.shape[1]
    half = head_dim // 2
    for name, t in (("q", q), ("k", k)):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name}: each token's heads must be contiguous; strides {t.stride()}")
    if head_dim % 2 or tuple(cos.shape[1:]) != (half,) or cos.shape != sin.shape:
        raise ValueError(f"cos and sin must be [P, {half}] for head_dim {head_dim}")
    if tokens:
        _rotary_kernel[(tokens,)](
            positions, q, k, cos, sin, q.stride(0), k.stride(0), num_q, num_k, half,
            BLOCK_D=triton.next_power_of_2(half),
            BLOCK_H=triton.next_power_of_2(max(num_q, num_k)), num_warps=4,
        )  # fmt: skip


@triton.jit
def _rotary_store_kernel(
    pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, key_cache_ptr, value_cache_ptr,
    q_stride, k_stride, v_stride, stride_cb, stride_cs, stride_ch, num_q_heads, num_kv_heads,
    half, block_size, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """`_rotary_kernel` and the KV write (triton_cache's) of one token in one program: q
    rotated in place, k rotated in place and into the cache at the token's slot, v into the
    cache (a slot of -1, a padded graph row: rotated, not stored)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    cols, cos, sin = _token_angles(pos_ptr, cos_ptr, sin_ptr, token, half, BLOCK_D)
    heads = tl.arange(0, BLOCK_H)[:, None]
    _rotate_heads(q_ptr + token * q_stride, num_q_heads, cos, sin, heads, cols, half)
    r1, r2 = _rotate_heads(k_ptr + token * k_stride, num_kv_heads, cos, sin, heads, cols, half)
    at = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + heads * stride_ch
    stored = (heads < num_kv_heads) & (cols < half) & (slot >= 0)
    tl.store(key_cache_ptr + at + cols, r1.to(key_cache_ptr.dtype.element_ty), mask=stored)
    tl.store(key_cache_ptr + at + cols + half, r2.to(key_cache_ptr.dtype.element_ty), mask=stored)
    src = v_ptr + token * v_stride + heads * (2 * half) + cols
    v1 = tl.load(src, mask=stored, other=0.0)
    v2 = tl.load(src + half, mask=stored, other=0.0)
    tl.store(value_cache_ptr + at + cols, v1.to(value_cache_ptr.dtype.element_ty), mask=stored)
    tl.store(
        value_cache_ptr + at + cols + half, v2.to(value_cache_ptr.dtype.element_ty), mask=stored
    )


def rotary_embedding_and_store(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`rotary_embedding(positions, q, k, cos, sin)` then `triton_cache.write_kv_cache(kv_cache,
    k, v, slot_mapping)`, the same bits, in one kernel instead of two: a decode step's layer
    launches one kernel fewer. v's heads must be contiguous as q's and k's (views of one qkv
    product are); kv_cache [2, num_blocks, block_size, Hkv, D] contiguous."""
    tokens, num_q, head_dim = q.shape
    num_k = k.shape[1]
    half = head_dim // 2
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name}: each token's heads must be contiguous; strides {t.stride()}")
    if head_dim % 2 or tuple(cos.shape[1:]) != (half,) or cos.shape != sin.shape:
        raise ValueError(f"cos and sin must be [P, {half}] for head_dim {head_dim}")
    if not kv_cache.is_contiguous() or tuple(kv_cache.shape[3:]) != (num_k, head_dim):
        raise ValueError(
            f"kv_cache must be contiguous [2, blocks, block_size, {num_k}, {head_dim}]"
        )
    if tokens:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        _rotary_store_kernel[(tokens,)](
            positions, slot_mapping, q, k, v, cos, sin, key_cache, value_cache,
            q.stride(0), k.stride(0), v.stride(0), key_cache.stride(0), key_cache.stride(1),
            key_cache.stride(2), num_q, num_k, half, key_cache.shape[1],
            BLOCK_D=triton.next_power_of_2(half),
            BLOCK_H=triton.next_power_of_2(max(num_q, num_k)), num_warps=4,
        )  # fmt: skip


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)  # F.silu, then rounded
    out = (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * width + cols, out, mask=mask)


SILU_BLOCK = 1024


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [T, 2I] (contiguous) -> a new [T, I]."""
    rows, double = gate_up.shape
    if double % 2 or not gate_up.is_contiguous():
        raise ValueError(f"gate_up must be contiguous [T, 2I]; got {tuple(gate_up.shape)}")
    width = double // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(width, SILU_BLOCK))](
            gate_up, out, width, BLOCK=SILU_BLOCK, num_warps=4
        )
    return out
