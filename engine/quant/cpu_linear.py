"""duet's own weight-only int8 and int4 linears for the CPU (engine/kernels/quant_linear_cpu.cpp):
int8 weights with an fp32 scale per output channel and group of columns (per channel, GGUF
Q8_0's 32, Q6_K's 16), int4 with a bf16 scale and offset per group, fp32 or bf16 activations,
AVX-512 / AVX2 / scalar from one source (and for bf16 the AVX512-BF16 dot, or AMX tiles).

Its weights are packed at load as [N / 16, K, 16] (16 output channels' column k contiguous),
scales as [N / 16, K / G, 16], N padded to a multiple of 16. A row's result does not depend on
how many rows share the call (docs/quantization.md).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from duet.engine.kernels.cpu import build_cpu_kernels, cpu_kernels_enabled

logger = logging.getLogger(__name__)

BLOCK = 16
"""Output channels per packed block."""

PANEL = 6
"""Blocks whose units (int8 column pairs, int4 quads, and both formats' scales per group)
interleave in the bf16 dot's layouts, so a one-row tile reads its weights as one stream and its
scales as another (the kernel's `panel()`)."""

SOURCES = ("quant_linear_cpu.cpp",)


def load_quant_kernels() -> Any | None:
    """The compiled module, or None when CPU kernels are off (`DUET_CPU_KERNELS=0`) or cannot
    be built (then torch's kernels or dequantizing serve int8)."""
    # NOTE: the setting is read before the cache: a process that built the module once still
    # honours `DUET_CPU_KERNELS=0` afterwards (and one that started with it off builds later).
    if not cpu_kernels_enabled():
        return None
    return _quant_kernels()


@functools.cache
def _quant_kernels() -> Any | None:
    try:
        return build_quant_kernels()
    except Exception as e:  # any build failure: fall back to the torch paths
        logger.warning("quantized CPU kernels unavailable (%s); using torch's", e)
        return None


def build_quant_kernels(defines: tuple[str, ...] = ()) -> Any:
    """Compile (or load the cached build of) the module; `defines` as `build_cpu_kernels`'s."""
    return build_cpu_kernels(defines, module="duet_quant_linear", sources=SOURCES)


def uses_pairs(kernels: Any, dtype: torch.dtype, group_size: int) -> bool:
    """Whether the kernel takes this layer's weights in pairs of columns: bf16 activations on an
    AVX512-BF16 build (vdpbf16ps, twice the multiply-adds of fp32 FMAs), even groups."""
    return dtype == torch.bfloat16 and bool(kernels.bf16_dot()) and group_size % 2 == 0


def uses_int4_pairs(kernels: Any, dtype: torch.dtype, group_size: int) -> bool:
    """`uses_pairs` for int4 weights, whose pairs come in quads: groups of a multiple of 8."""
    return uses_pairs(kernels, dtype, group_size) and group_size % 8 == 0


def uses_amx(kernels: Any, dtype: torch.dtype, group_size: int) -> bool:
    """Whether this layer's pairs go through AMX tiles (Sapphire Rapids and later, bf16, groups
    of a multiple of 32 columns: every format but Q6_K's 16)."""
    return uses_pairs(kernels, dtype, group_size) and bool(kernels.amx()) and group_size % 32 == 0


def interleave(units: torch.Tensor, panel: int) -> torch.Tensor:
    """[blocks, U, bytes] -> flat, panels of `panel` blocks (the last may hold fewer) one after
    another, each panel's unit t being its blocks' units t side by side."""
    parts = [units[first : first + panel].transpose(0, 1).reshape(-1)
             for first in range(0, units.shape[0], panel)]  # fmt: skip
    return torch.cat(parts)


def deinterleave(
    flat: torch.Tensor, blocks: int, units: int, size: int, panel: int
) -> torch.Tensor:
    """The inverse of `interleave`: [blocks, units, size]."""
    parts = []
    for first in range(0, blocks, panel):
        width = min(panel, blocks - first)
        span = flat[first * units * size : (first + width) * units * size]
        parts.append(span.view(units, width, size).transpose(0, 1))
    return torch.cat(parts)


def pack_int8(
    q: torch.Tensor, scale: torch.Tensor, pairs: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ([N, K] int8) and scale ([N, K / G] fp32) in the kernel's layout: ([N' / 16, K, 16],
    [N' / 16, K / G, 16]), N' = N rounded up to 16, padded with zero rows and scales. `pairs`:
    q as [N' / 16, K / 2, 16, 2] instead (columns 2j and 2j + 1 side by side per channel), the
    32-byte pairs of `PANEL` neighbouring blocks interleaved (a panel's pair j is its blocks'
    pairs j side by side), and their scales the same way (a panel's group g: its blocks' 16
    scales of group g side by side)."""
    n, k = q.shape
    pad = -n % BLOCK
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
    blocks = (n + pad) // BLOCK
    scales = scale.float().reshape(blocks, BLOCK, -1).transpose(1, 2).contiguous()
    if pairs:
        packed = q.view(blocks, BLOCK, k // 2, 2).permute(0, 2, 1, 3).reshape(blocks, k // 2, 32)
        packed = interleave(packed, PANEL).view(blocks, k // 2, BLOCK, 2)
        scales = interleave(scales, PANEL).view(scales.shape)
    else:
        packed = q.view(blocks, BLOCK, k).transpose(1, 2).contiguous()
    return packed, scales


def unpack_int8(
    packed: torch.Tensor, scales: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_int8`: (q [n, K], scale [n, K / G])."""
    blocks = packed.shape[0]
    if packed.dim() == 4:  # pairs
        units = deinterleave(packed.reshape(-1), blocks, packed.shape[1], 32, PANEL)
        q = units.view(packed.shape).permute(0, 2, 1, 3).reshape(blocks * BLOCK, -1)[:n]
        units = deinterleave(scales.reshape(-1), blocks, scales.shape[1], BLOCK, PANEL)
        scales = units.view(scales.shape)
    else:
        q = packed.transpose(1, 2).reshape(blocks * BLOCK, -1)[:n]
    scale = scales.transpose(1, 2).reshape(blocks * BLOCK, -1)[:n]
    return q, scale


def int8_linear(
    kernels: Any,
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    amx_min_rows: int = 1,
) -> torch.Tensor:
    """x ([M, K], fp32 or bf16, rows contiguous) @ (q * scale).T -> [M, n] of x's dtype. Pairs
    on an AMX CPU (`uses_amx`) take the tiles from `amx_min_rows` rows, the bf16 dot below."""
    out: torch.Tensor = kernels.int8_linear(x, packed, scales, n, amx_min_rows)
    return out


def pack_int4(
    q: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    pairs: bool = True,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 (q [N, K] in [0, 15], w = q * scale + offset, offset None: -8 * scale) in the int4
    kernel's layout: nibbles [N' / 16, K / 2, 16] and scales and offsets [N' / 16, K / G, 2, 16]
    of `scale_dtype` (bf16, as torch's int4 kernel holds them; or, without `pairs`, fp32: a GGUF
    file's exact values). `pairs` (the bf16 dot; K a multiple of 8): column pair j's 32 values
    (value v: channel v // 2, column 2j + v % 2) in quads of pairs, 64 bytes for pairs 4t .. 4t
    + 3 read as 32 little-endian 16-bit words, value v of pair 4t + s in bits 4s .. 4s + 3 of
    word v, and the quads of `PANEL` neighbouring blocks interleave (a panel's quad t is its
    blocks' quads t side by side), as do the scales and offsets (a panel's group g: its blocks'
    32 values of group g side by side); else (fp32 FMAs) byte c holds channel c's columns 2j
    (low) and 2j + 1 (high). Padded rows are zero."""
    n, k = q.shape
    scale_bf16 = scale.to(scale_dtype)
    if offset is None:  # exact: -8 times a bf16
        offset = -8 * scale_bf16.float()
    pad = -n % BLOCK
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scale_bf16 = torch.cat([scale_bf16, scale_bf16.new_zeros(pad, scale.shape[1])])
        offset = torch.cat([offset, offset.new_zeros(pad, offset.shape[1])])
    blocks = (n + pad) // BLOCK
    values = q.to(torch.uint8).view(blocks, BLOCK, k // 2, 2)
    sz = torch.stack([scale_bf16, offset.to(scale_dtype)], dim=-1)  # [N', K / G, 2]
    sz = sz.view(blocks, BLOCK, -1, 2).permute(0, 2, 3, 1).contiguous()
    if pairs:
        if k % 8:
            raise ValueError(f"int4 pairs need K a multiple of 8 (whole quads); got {k}")
        values = values.permute(0, 2, 1, 3).reshape(blocks, k // 8, 4, 2 * BLOCK)
        low = values[:, :, 0] | (values[:, :, 1] << 4)  # word v's first byte
        high = values[:, :, 2] | (values[:, :, 3] << 4)
        quads = torch.stack([low, high], dim=-1).reshape(blocks, k // 8, 64)
        nibbles = interleave(quads, PANEL).view(blocks, k // 2, BLOCK)
        sz = interleave(sz.view(blocks, sz.shape[1], 2 * BLOCK), PANEL).view(sz.shape)
    else:
        nibbles = (values[..., 0] | (values[..., 1] << 4)).transpose(1, 2).contiguous()
    return nibbles, sz


def unpack_int4(
    nibbles: torch.Tensor, sz: torch.Tensor, n: int, pairs: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack_int4`: (q [n, K] uint8, scale [n, K / G], offset [n, K / G]) with
    the scales and offsets as fp32."""
    blocks, num_pairs, _ = nibbles.shape
    if pairs:
        quads = deinterleave(nibbles.reshape(-1), blocks, num_pairs // 4, 64, PANEL)
        words = quads.view(blocks, num_pairs // 4, 2 * BLOCK, 2)
        low, high = words[..., 0], words[..., 1]
        values = torch.stack([low & 0x0F, low >> 4, high & 0x0F, high >> 4], dim=2)
        values = values.view(blocks, num_pairs, BLOCK, 2).permute(0, 2, 1, 3)
        sz = deinterleave(sz.reshape(-1), blocks, sz.shape[1], 2 * BLOCK, PANEL).view(sz.shape)
    else:
        values = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-1).transpose(1, 2)
    q = values.reshape(blocks * BLOCK, -1)
    sz = sz.permute(0, 3, 1, 2).reshape(blocks * BLOCK, -1, 2).float()
    return q[:n], sz[:n, :, 0], sz[:n, :, 1]


def int4_linear(
    kernels: Any,
    x: torch.Tensor,
    nibbles: torch.Tensor,
    sz: torch.Tensor,
    n: int,
    pairs: bool = True,
    amx_min_rows: int = 1,
) -> torch.Tensor:
    """x ([M, K], rows contiguous; bf16 for `pairs`, else fp32 or bf16) @ (q * scale +
    offset).T -> [M, n] of x's dtype. AMX as `int8_linear`'s."""
    out: torch.Tensor = kernels.int4_linear(x, nibbles, sz, n, pairs, amx_min_rows)
    return out
