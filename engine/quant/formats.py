"""duet's quantized weight formats, exact: what round-to-nearest and GGUF repacking produce.

Two formats cover every method (docs/quantization.md):

- `Int8Weight`: `w = q * scale`, q int8 [N, K], one scale per output row and group of
  `group_size` columns (group_size == K: per output channel). GGUF Q8_0 (groups of 32) and
  Q6_K (groups of 16, q in [-32, 31]) repack into it.
- `Int4Weight`: q in [0, 15] [N, K] (one byte each while loading), scales per row and group;
  symmetric `w = (q - 8) * scale`, asymmetric `w = q * scale + offset`. GGUF Q4_0 (symmetric),
  Q4_1 and Q4_K (asymmetric, offset = -dmin * m) repack into it, groups of 32.

Scales and offsets are fp32, and `dequantize` evaluates the same fp32 expression, in the same
order, as `gguf.quants.dequantize`, so a repacked block dequantizes bit-exactly. These are load-
time forms: `QuantizedLinear` turns them into its kernels' layout (engine/model/
quantized_linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from duet.engine.errors import ModelLoadError


@dataclass
class Int8Weight:
    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N, K // group_size] fp32
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        q = self.q.float().view(n, k // self.group_size, self.group_size)
        return (q * self.scale[..., None]).view(n, k)  # [N, K] fp32

    def narrow(self, dim: int, start: int, length: int) -> Int8Weight:
        if dim == 0:
            return Int8Weight(
                self.q.narrow(0, start, length), self.scale.narrow(0, start, length),
                self.group_size,
            )  # fmt: skip
        if self.group_size == self.shape[1]:  # per channel: requantizing would be needed
            raise ModelLoadError(
                "tensor_parallel_size: an int8 per-channel weight cannot be split along its "
                "input dimension; quantize after sharding (a dense checkpoint) instead"
            )
        g0, g1 = _group_range(start, length, self.group_size)
        return Int8Weight(self.q.narrow(1, start, length), self.scale[:, g0:g1], self.group_size)

    def permute_rows(self, index: torch.Tensor) -> Int8Weight:
        return Int8Weight(self.q[index], self.scale[index], self.group_size)

    def same_kind(self, other: object) -> bool:
        return isinstance(other, Int8Weight) and other.group_size == self.group_size

    @staticmethod
    def cat_rows(parts: list[Int8Weight]) -> Int8Weight:
        return Int8Weight(
            torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
            parts[0].group_size,
        )  # fmt: skip


@dataclass
class Int4Weight:
    q: torch.Tensor  # [N, K] uint8 in [0, 15]
    scale: torch.Tensor  # [N, K // group_size] fp32
    offset: torch.Tensor | None  # [N, K // group_size] fp32; None: symmetric, zero at q = 8
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    @property
    def symmetric(self) -> bool:
        return self.offset is None

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        groups = (n, k // self.group_size, self.group_size)
        if self.offset is None:
            q = (self.q.to(torch.int8) - 8).float().view(groups)
            return (self.scale[..., None] * q).view(n, k)  # [N, K] fp32
        q = self.q.float().view(groups)
        return (self.scale[..., None] * q + self.offset[..., None]).view(n, k)

    def narrow(self, dim: int, start: int, length: int) -> Int4Weight:
        if dim == 0:
            offset = None if self.offset is None else self.offset.narrow(0, start, length)
            return Int4Weight(
                self.q.narrow(0, start, length), self.scale.narrow(0, start, length), offset,
                self.group_size,
            )  # fmt: skip
        g0, g1 = _group_range(start, length, self.group_size)
        offset = None if self.offset is None else self.offset[:, g0:g1]
        return Int4Weight(
            self.q.narrow(1, start, length), self.scale[:, g0:g1], offset, self.group_size
        )

    def permute_rows(self, index: torch.Tensor) -> Int4Weight:
        offset = None if self.offset is None else self.offset[index]
        return Int4Weight(self.q[index], self.scale[index], offset, self.group_size)

    def same_kind(self, other: object) -> bool:
        return (
            isinstance(other, Int4Weight)
            and other.group_size == self.group_size
            and other.symmetric == self.symmetric
        )

    @staticmethod
    def cat_rows(parts: list[Int4Weight]) -> Int4Weight:
        offsets = [p.offset for p in parts]
        offset = None if offsets[0] is None else torch.cat(offsets)  # type: ignore[arg-type]
        return Int4Weight(
            torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), offset,
            parts[0].group_size,
        )  # fmt: skip


QuantizedWeight = Int8Weight | Int4Weight
Part = QuantizedWeight | torch.Tensor
"""A checkpoint's rows of a layer: quantized, or dense."""


def _group_range(start: int, length: int, group_size: int) -> tuple[int, int]:
    if start % group_size or length % group_size:
        raise ModelLoadError(
            f"tensor_parallel_size: a shard of columns [{start}, {start + length}) does not "
            f"fall on the weight's quantization groups of {group_size}; use a smaller "
            "tensor_parallel_size or a group size that divides the shard"
        )
    return start // group_size, (start + length) // group_size


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> Int8Weight:
    """Round to nearest, one symmetric scale per output channel, or per group of `group_size`
    columns as GGUF Q8_0 (32) holds them (q in [-127, 127])."""
    w = weight.detach().float()  # [N, K]
    n, k = w.shape
    group = k if group_size is None else group_size
    groups = w.view(n, k // group, group)
    scale = groups.abs().amax(dim=-1) / 127  # [N, K / G]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(groups / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.view(n, k), scale, group)


def quantize_int4(weight: torch.Tensor, group_size: int, symmetric: bool) -> Int4Weight:
    """Round to nearest per group of `group_size` columns: symmetric (scale = max|w| / 7,
    q - 8 in [-8, 7]) or asymmetric (scale = (max - min) / 15, offset = min)."""
    n, k = weight.shape
    if k % group_size:
        raise ModelLoadError(
            f"quantization_group_size: {group_size} does not divide a weight's input size {k}"
        )
    w = weight.detach().float().view(n, k // group_size, group_size)
    if symmetric:
        scale = w.abs().amax(dim=-1) / 7
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(w / scale[..., None]).clamp(-8, 7) + 8
        offset = None
    else:
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scale = (high - low) / 15
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15)
        offset = low
    return Int4Weight(q.to(torch.uint8).view(n, k), scale, offset, group_size)


INT4_BLOCK_N = 64
"""Rows per block of torch's CPU int4 layout (`_convert_weight_to_int4pack_for_cpu`)."""


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q ([N, K] in [0, 15], N a multiple of 64) in the layout of torch's CPU int4 kernel:
    per block of 64 rows and each column k, 32 bytes holding row j in the low nibble and row
    j + 32 in the high one. Returns [N, K // 2] uint8 (what the torch op returns)."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n // INT4_BLOCK_N, INT4_BLOCK_N, k).transpose(1, 2)
    half = INT4_BLOCK_N // 2
    return (blocks[..., :half] | (blocks[..., half:] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: [N, K // 2] uint8 -> [N, K] uint8 in [0, 15]."""
    n, half_k = packed.shape
    k = half_k * 2
    blocks = packed.view(n // INT4_BLOCK_N, k, INT4_BLOCK_N // 2)
    rows = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)  # [N / 64, K, 64]
    return rows.transpose(1, 2).reshape(n, k)


def runs_of_one_format(parts: list[Part]) -> list[list[Part]]:
    """`parts` (in row order) cut into runs that one layer can hold: dense parts together,
    quantized parts of the same format (kind, group size, symmetry) together."""
    runs: list[list[Part]] = []
    for part in parts:
        if runs and _same_format(runs[-1][-1], part):
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def _same_format(a: Part, b: Part) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return a.same_kind(b)
