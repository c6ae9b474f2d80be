"""Weight-only quantized linear layers: int8 and int4 weights, activations in the model dtype.

Which product runs (measured with torch 2.13 on a 2-core AVX512-BF16 EPYC, docs/quantization.md):

- int8 (per output channel or per group: GGUF Q8_0, Q6_K) on the CPU, fp32 or bf16: duet's own
  kernel (engine/kernels/quant_linear_cpu.cpp via engine/quant/cpu_linear.py), 1.3-4x faster
  than `aten._weight_int8pack_mm` at 1-256 rows; above `INT8_KERNEL_MAX_ROWS` the weight is
  dequantized for the call. Without a compiler: torch's kernel (per channel, bf16) or dequantize.
- int4 on the CPU, fp32 or bf16: duet's int4 kernel, the bf16 dot on nibbles with bf16 on an
  AVX512-BF16 CPU (1.7-2.2x `aten._weight_int4pack_mm_for_cpu` at 1-256 rows), else fp32 FMAs
  on nibbles. Above `kernel_max_rows` (256 dot, 32 FMAs) the weight is dequantized for the
  call. Without a compiler: torch's int4 kernel in bf16 (up to 16 rows), else dequantize.
- bf16 on an AMX CPU (groups of a multiple of 32): AMX tiles (`_tile_dpbf16ps`) on the same
  converted pairs, at every row count from `AMX_MIN_ROWS` (the dot below), 4-9x the dot's speed
  at 32-256 rows and faster than dequantizing into oneDNN's bf16 matmul.
- Deterministic mode keeps one product at every row count (docs/determinism.md): the kernel
  always, and on AMX the tiles from one row. Every kernel computes each row on its own (probed,
  `row_invariant.check_model`).
- CUDA: the Triton W8A16 / W4A16 kernel (engine/quant/triton_linear.py) up to 128 rows, the
  weight dequantized for cuBLAS above; run on an H200 (docs/quantization.md, "On a GPU").
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from duet.engine.errors import ModelLoadError
from duet.engine.model.concat_linear import ConcatLinear
from duet.engine.model.row_invariant import MIN_ROWS, Linear, linear_rows
from duet.engine.quant.config import QuantizationConfig
from duet.engine.quant.cpu_linear import (
    load_quant_kernels,
    pack_int8,
    unpack_int8,
    uses_amx,
    uses_int4_pairs,
    uses_pairs,
)
from duet.engine.quant.cpu_linear import pack_int4 as pack_int4_pairs
from duet.engine.quant.cpu_linear import unpack_int4 as unpack_int4_pairs
from duet.engine.quant.formats import (
    INT4_BLOCK_N,
    Int4Weight,
    Int8Weight,
    Part,
    QuantizedWeight,
    pack_int4,
    quantize_int4,
    quantize_int8,
    runs_of_one_format,
    unpack_int4,
)

logger = logging.getLogger(__name__)

KERNEL_MAX_ROWS = 16
"""Most rows torch's int8/int4 kernels take outside deterministic mode; more are dequantized
and multiplied densely (the crossover measured above lies between 16 and 64 rows)."""
INT8_KERNEL_MAX_ROWS = {True: 256, False: 32}
"""The same for duet's int8 kernel, by whether it runs the bf16 dot (AVX512-BF16; else fp32
FMAs): from there dequantizing and multiplying densely is as fast (docs/quantization.md)."""
INT4_KERNEL_MAX_ROWS = {True: 256, False: 32}
"""The same for duet's int4 kernel, by whether it runs the bf16 dot (else fp32 FMAs)."""
AMX_MIN_ROWS = 2
"""Fewest rows an AMX layer (`uses_amx`) gives the tiles outside deterministic mode; one row
takes the bf16 dot, 0-16% faster there (the tiles are 1.2-1.4x faster at two rows) on a 2-core
Xeon with AMX (docs/quantization.md). Such a layer takes its kernel at every row count: the
tiles beat dequantizing into oneDNN's bf16 matmul from 1 to 256 rows."""

UNLIMITED = 1 << 62

_WARNED_K: set[int] = set()


class QuantizedLinear(nn.Module):
    """`y = x @ W.T (+ b)` with W held as int8 or int4.

    Built empty with its shape; the loader hands it its weight in row ranges (`load_part`: a
    fused q|k|v gets three), then `finalize` builds the kernel layout (or a replacement).
    """

    min_rows: int = MIN_ROWS
    kernel_max_rows: int = KERNEL_MAX_ROWS
    amx_min_rows: int = AMX_MIN_ROWS

    def __init__(
        self, in_features: int, out_features: int, bias: bool, config: QuantizationConfig
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.config = in_features, out_features, config
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._parts: dict[int, Part] = {}
        self.kind = ""  # "int8", "int8-grouped" or "int4" once finalized
        self.group_size = in_features
        self.symmetric = True
        self.use_kernel = False
        self.use_triton = False
        self.pairs = False  # duet's kernels: weights in the bf16 dot's column pairs
        self._padded_rows = out_features
        self.duet_kernels: Any = None  # duet's kernel module when it serves this layer

    # -- loading -------------------------------------------------------------------------------

    def load_part(self, row_offset: int, part: Part) -> None:
        """Rows [row_offset, row_offset + rows) of the weight: quantized (GGUF), or dense (then
        rounded to nearest here, one part at a time; int8 and int4 scales are per row, so the
        parts quantize as the whole would)."""
        if isinstance(part, torch.Tensor) and self.config.method in ("int8", "int4"):
            part = self._round(part)
        self._parts[row_offset] = part

    def _round(self, weight: torch.Tensor) -> QuantizedWeight:
        if self.config.method == "int8":
            return quantize_int8(weight)
        group_size = self.config.group_size
        while self.in_features % group_size and group_size > 32:
            group_size //= 2  # e.g. 128 on SmolLM2's K = 576: 64
        if group_size != self.config.group_size and self.in_features not in _WARNED_K:
            _WARNED_K.add(self.in_features)
            logger.warning(
                "quantization_group_size %d does not divide input size %d: groups of %d there",
                self.config.group_size, self.in_features, group_size,
            )  # fmt: skip
        return quantize_int4(weight, group_size, self.config.symmetric)

    def finalize(self, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """Assemble the parts; returns self, or the layer replacing it: a dense `Linear` when
        the checkpoint holds the weight unquantized, a `ConcatLinear` when its parts mix
        formats."""
        parts = [self._parts[k] for k in sorted(self._parts)]
        self._parts = {}
        num_rows = sum(p.shape[0] for p in parts)
        if num_rows != self.out_features:
            raise ModelLoadError(
                f"a {self.out_features}x{self.in_features} layer's checkpoint tensors hold "
                f"{num_rows} of its {self.out_features} rows"
            )
        runs = runs_of_one_format(parts)
        first = parts[0]
        if len(runs) == 1:
            if isinstance(first, torch.Tensor):
                return self._dense(parts, dtype, device)
            self.set_weight(type(first).cat_rows(parts), dtype, device)  # type: ignore[arg-type]
            return self
        # A GGUF mixing formats in one fused layer (Q4_K_M: Q4_K q, k with a Q6_K v): a layer
        # per run of one format, each kept in its format (engine/model/concat_linear.py).
        kinds = [type(run[0]).__name__.removesuffix("Weight") for run in runs]
        logger.info(
            "a %dx%d layer mixes weight formats: kept as %d layers side by side (%s)",
            self.out_features, self.in_features, len(runs), " | ".join(kinds),
        )  # fmt: skip
        layers, row = [], 0
        for run in runs:
            rows = sum(p.shape[0] for p in run)
            layer = QuantizedLinear(self.in_features, rows, self.bias is not None, self.config)
            if self.bias is not None:
                bias = self.bias.detach()[row : row + rows].clone()
                layer.bias = nn.Parameter(bias, requires_grad=False)
            for part in run:
                layer.load_part(row, part)
                row += part.shape[0]
            layers.append(layer.finalize(dtype, device))
        return ConcatLinear(layers, self.in_features, self.out_features)

    def _dense(self, parts: list[Part], dtype: torch.dtype, device: torch.device) -> Linear:
        full = torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts])
        # NOTE: row_invariant.Linear, not nn.Linear: the load-time probe must see it.
        linear = Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear = linear.to(device=device, dtype=dtype).requires_grad_(False)
        with torch.no_grad():
            linear.weight.copy_(full)
            if self.bias is not None and linear.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def set_weight(
        self,
        weight: QuantizedWeight,
        dtype: torch.dtype,
        device: torch.device,
        triton: bool | None = None,
    ) -> None:
        """Hold `weight` in the layout of the product that runs for `dtype` on `device`.
        `triton`: the Triton kernels (engine/quant/triton_linear.py); None: on CUDA."""
        n, k = weight.shape
        self.group_size = weight.group_size
        on_cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16
        for name in ("q", "scale", "packed", "scales_zeros", "offset", "zero"):
            self.register_buffer(name, None, persistent=False)
        self.duet_kernels, self.pairs, self.amx = None, False, False
        self.use_triton = device.type == "cuda" if triton is None else triton
        if self.use_triton:
            self._set_triton_weight(weight, dtype, device)
            return
        self._padded_rows = -(-n // INT4_BLOCK_N) * INT4_BLOCK_N
        if isinstance(weight, Int8Weight):
            per_channel = weight.group_size == k
            self.kind = "int8" if per_channel else "int8-grouped"
            kernels = load_quant_kernels() if device.type == "cpu" else None
            if kernels is not None and dtype in (torch.float32, torch.bfloat16):
                # duet's kernel: fp32 scales, the weights as the format holds them
                self.duet_kernels, self.use_kernel = kernels, True
                self.pairs = uses_pairs(kernels, dtype, weight.group_size)
                self.amx = uses_amx(kernels, dtype, weight.group_size)
                self.kernel_max_rows = UNLIMITED if self.amx else INT8_KERNEL_MAX_ROWS[self.pairs]
                self.q, self.scale = pack_int8(weight.q, weight.scale, self.pairs)
                return
            self.use_kernel = per_channel and on_cpu_bf16
            self.q = weight.q.to(device)
            scale = weight.scale.squeeze(1) if per_channel else weight.scale
            self.scale = scale.to(device, dtype if self.use_kernel else torch.float32)
            return
        self.kind, self.symmetric = "int4", weight.symmetric
        kernels = load_quant_kernels() if device.type == "cpu" else None
        if kernels is not None and dtype in (torch.float32, torch.bfloat16):
            # duet's int4 kernel: bf16 scales and offsets, as torch's kernel holds them
            self.duet_kernels, self.use_kernel = kernels, True
            self.pairs = uses_int4_pairs(kernels, dtype, weight.group_size)
            self.amx = uses_amx(kernels, dtype, weight.group_size)
            self.kernel_max_rows = UNLIMITED if self.amx else INT4_KERNEL_MAX_ROWS[self.pairs]
            # A GGUF file's scales stay exact with fp32 FMAs (the bf16 dot takes bf16 ones).
            exact = self.config.method == "gguf" and not self.pairs
            self.packed, self.scales_zeros = pack_int4_pairs(
                weight.q, weight.scale, weight.offset, self.pairs,
                torch.float32 if exact else torch.bfloat16,
            )  # fmt: skip
            return
        self.use_kernel = on_cpu_bf16
        if self.use_kernel:  # the kernel's w = (q - 8) * scale + zero, zero per group
            zero = torch.zeros_like(weight.scale)
            if weight.offset is not None:
                zero = weight.offset + 8 * weight.scale
            self.packed, self.scales_zeros = self._int4_kernel_operands(
                weight.q, weight.scale, zero, dtype, device
            )
        else:  # exact fp32 scales: dequantizes as the format does (bit-exact for GGUF)
            self.packed, _ = self._int4_kernel_operands(
                weight.q, weight.scale, weight.scale, dtype, device
            )
            self.scale = weight.scale.to(device)
            self.offset = None if weight.offset is None else weight.offset.to(device)

    def _int4_kernel_operands(
        self,
        q: torch.Tensor,  # [N, K] in [0, 15]
        scale: torch.Tensor,  # [N, K / G]
        zero: torch.Tensor,  # [N, K / G]
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed [N padded, K / 2], scales_zeros [K / G, N padded, 2]): torch's CPU int4
        kernel operands, rows padded to its blocks of 64."""
        pad = self._padded_rows - q.shape[0]
        if pad:
            q = torch.cat([q, q.new_full((pad, q.shape[1]), 8)])
        scales_zeros = torch.stack([scale, zero], dim=-1)  # [N, K / G, 2]
        if pad:
            scales_zeros = torch.cat(
                [scales_zeros, scales_zeros.new_zeros(pad, *scale.shape[1:], 2)]
            )
        packed = pack_int4(q).to(device)
        return packed, scales_zeros.transpose(0, 1).contiguous().to(device, dtype)

    def _set_triton_weight(
        self, weight: QuantizedWeight, dtype: torch.dtype, device: torch.device
    ) -> None:
        from duet.engine.quant.triton_linear import pack_int4_rows

        self.use_kernel = False
        if isinstance(weight, Int8Weight):
            self.kind = "int8" if weight.group_size == weight.shape[1] else "int8-grouped"
            self.q, self.scale = weight.q.to(device), weight.scale.to(device, dtype)
            return
        self.kind, self.symmetric = "int4", weight.symmetric
        zero = -8 * weight.scale if weight.offset is None else weight.offset  # w = q s + zero
        self.packed = pack_int4_rows(weight.q).to(device)  # [N, K / 2]
        self.scale, self.zero = weight.scale.to(device, dtype), zero.to(device, dtype)

    # -- compute -------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self.duet_kernels
        if kernels is not None and x.dim() == 2 and x.stride(1) == 1:
            # NOTE: rows as they are (every CPU decode step) straight to duet's kernel:
            # linear_rows and _product cost 2.7 us of Python a projection over the kernel's
            # call (121 a SmolLM2 token), this about 1.
            if self.min_rows <= x.shape[0] <= self.kernel_max_rows:
                return self._on_duet_kernel(kernels, x)
        return linear_rows(x, self._product, self.min_rows)

    def _on_duet_kernel(self, kernels: Any, rows: torch.Tensor) -> torch.Tensor:
        b = self._buffers  # (the dicts: `self.packed` is a Python call, nn.Module.__getattr__)
        out: torch.Tensor
        if self.kind == "int4":
            out = kernels.int4_linear(
                rows, b["packed"], b["scales_zeros"], self.out_features, self.pairs,
                self.amx_min_rows,
            )  # fmt: skip
        else:
            out = kernels.int8_linear(
                rows, b["q"], b["scale"], self.out_features, self.amx_min_rows
            )
        bias = self._parameters.get("bias")
        if bias is not None:
            out += bias
        return out

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from duet.engine.quant.triton_linear import w4a16_linear, w8a16_linear

            if self.kind == "int4":
                return w4a16_linear(rows, self.packed, self.scale, self.zero, self.bias)
            return w8a16_linear(rows, self.q, self.scale, self.bias)
        if not (
            self.use_kernel
            and (rows.dtype == torch.bfloat16 or self.duet_kernels is not None)
            and rows.shape[0] <= self.kernel_max_rows
        ):
            return F.linear(rows, self.dequantize(rows.dtype), self.bias)
        if self.duet_kernels is not None:
            return self._on_duet_kernel(self.duet_kernels, rows)
        if self.kind == "int8":
            out = torch.ops.aten._weight_int8pack_mm(rows, self.q, self.scale)
        else:
            rows = rows.contiguous()
            int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
            out = int4_mm(rows, self.packed, self.group_size, self.scales_zeros)
            if self._padded_rows != self.out_features:
                out = out[:, : self.out_features].contiguous()
        if self.bias is not None:
            out += self.bias
        return out

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as the dense [N, K] matrix the kernels stand for."""
        n, k = self.out_features, self.in_features
        if self.kind.startswith("int8"):
            q, scale = self.q, self.scale
            if self.duet_kernels is not None:
                q, scale = unpack_int8(q, scale, n)
            groups = q.reshape(n, -1, self.group_size).to(scale.dtype)
            scale = scale.reshape(n, -1, 1)
            return (groups * scale).view(n, k).to(dtype)
        if self.use_triton:  # row layout: column 2j low nibble, 2j + 1 high
            q = torch.stack([self.packed & 0x0F, self.packed >> 4], dim=-1).view(n, k)
            groups = q.to(self.scale.dtype).view(n, -1, self.group_size)
            w = groups * self.scale[..., None] + self.zero[..., None]
            return w.view(n, k).to(dtype)
        if self.duet_kernels is not None:
            q, scale, offset = unpack_int4_pairs(self.packed, self.scales_zeros, n, self.pairs)
            groups = q.float().view(n, -1, self.group_size)
            return (groups * scale[..., None] + offset[..., None]).view(n, k).to(dtype)
        q = unpack_int4(self.packed)[:n]
        if self.use_kernel:
            sz = self.scales_zeros[:, :n].transpose(0, 1).float()  # [N, K / G, 2]
            q = (q.to(torch.int8) - 8).float().view(n, -1, self.group_size)
            return (q * sz[..., :1] + sz[..., 1:]).view(n, k).to(dtype)
        weight = Int4Weight(q, self.scale, self.offset, self.group_size)
        return weight.dequantize().to(dtype)

    def weight_bytes(self) -> int:
        """Bytes of the quantized weight and its scales (bias excluded)."""
        return sum(b.nbytes for b in self.buffers(recurse=False))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"kind={self.kind or 'unloaded'}, group_size={self.group_size}, kernel={self.use_kernel}"
        )


def quantize_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, config: QuantizationConfig, dtype: torch.dtype
) -> QuantizedLinear:
    """A finalized `QuantizedLinear` of a dense weight ([N, K]), rounded to nearest."""
    layer = QuantizedLinear(weight.shape[1], weight.shape[0], bias is not None, config)
    if bias is not None and layer.bias is not None:
        layer.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
    layer.load_part(0, weight)
    result = layer.finalize(dtype, weight.device)
    assert result is layer
    return layer


def set_kernel_max_rows(model: nn.Module, rows: int | None) -> None:
    """Most rows every `QuantizedLinear` under `model` gives its kernel (None: all of them, and
    an AMX layer's tiles take every row count, so each row takes one product whatever its batch:
    deterministic mode)."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.kernel_max_rows = rows if rows is not None else UNLIMITED
            module.amx_min_rows = AMX_MIN_ROWS if rows is not None else 1
