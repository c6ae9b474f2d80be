"""A sparse layer's int8 or int4 routed experts on the CPU as grouped products on duet's
quantized kernels (engine/kernels/quant_linear_cpu.cpp: `grouped_int8_linear`,
`grouped_int4_linear`): the step's rows, sorted by expert, take one call for every expert's
gate|up product, one pass of SiLU(gate) * up, and one call for every down product, instead of
a Python-driven `QuantizedLinear` pair per expert (a decode step of 32 sequences at top-8 of
128 experts sent rows to ~100 experts: ~200 kernel calls a layer, each a few rows' work).

Each expert's rows are exactly the product its own `QuantizedLinear` would compute (the same
tiles, and on an AMX CPU the same choice of tiles or bf16 dot by its row count), so the
outputs are bit for bit the per-expert loop's, in every mode (docs/determinism.md). An expert
that received more rows than its layers give their kernel (`kernel_max_rows`: a long prefill)
is left out of the grouped call and computed by its own layers, which dequantize for it.

The stacked operands are the experts' own: each layer's buffers become views of the stacks,
so grouping costs no memory, and the per-expert layers stay usable for that fallback.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from duet.engine.model.mlp import silu_and_mul
from duet.engine.model.quantized_linear import QuantizedLinear

OPERANDS = {"int8": ("q", "scale"), "int4": ("packed", "scales_zeros")}
"""The buffers of a `QuantizedLinear` on duet's kernel that its kernel call takes, by kind."""


class CpuGroupedQuantExperts(nn.Module):
    """Every local expert's gate|up and down `QuantizedLinear`s (on duet's kernels, one kind
    and layout) with their operands stacked per projection. Build with `from_experts`."""

    def __init__(self, experts: list[nn.Module], kind: str) -> None:
        super().__init__()
        self.mlps = experts  # not registered: the block's `experts` own them
        pairs: list[tuple[QuantizedLinear, QuantizedLinear]] = [
            (_layer(e, "gate_up_proj"), _layer(e, "down_proj")) for e in experts
        ]
        self.pairs = pairs
        self.kind = kind
        self.num_experts = len(pairs)
        gate_up, down = pairs[0]
        self.intermediate_size: int = gate_up.out_features // 2
        self.hidden_size: int = down.out_features
        self.kernel: Any = gate_up.duet_kernels
        names = OPERANDS[kind]
        for proj, index in (("w13", 0), ("w2", 1)):
            layers = [pair[index] for pair in pairs]
            for name in names:  # stacked, each layer's buffer then a view of its slice
                stack = torch.stack([_buffer(layer, name) for layer in layers])
                self.register_buffer(f"{proj}_{name}", stack, persistent=False)
                for e, layer in enumerate(layers):
                    layer._buffers[name] = stack[e]

    @classmethod
    def from_experts(cls, experts: nn.ModuleList) -> CpuGroupedQuantExperts | None:
        """The grouped form of `experts` (MLPs whose gate_up_proj and down_proj are
        `QuantizedLinear`s on duet's CPU kernels, without bias, every expert's alike); None
        when they are not all such (nothing changed then)."""
        pairs = [(getattr(e, "gate_up_proj", None), getattr(e, "down_proj", None)) for e in experts]
        if not pairs:
            return None
        kinds = {_kernel_kind(m) for pair in pairs for m in pair}
        if len(kinds) != 1 or None in kinds:
            return None
        for name in ("gate_up_proj", "down_proj"):  # every expert's alike: one layout, one stack
            if len({_signature(_layer(e, name)) for e in experts}) != 1:
                return None
        kind = kinds.pop()
        assert kind is not None
        return cls(list(experts), kind)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`rows` [S, hidden] sorted by expert, `counts[e]` of local expert e: each row's
        expert output [S, hidden]."""
        gate_up, _ = self.pairs[0]
        # As each layer decides for its own call: it pads fewer than `min_rows` rows up to
        # `min_rows` (so the tiles' row threshold counts those), and dequantizes above
        # `kernel_max_rows`.
        amx_min_rows = 1 if gate_up.min_rows >= gate_up.amx_min_rows else gate_up.amx_min_rows
        max_rows = gate_up.kernel_max_rows
        if gate_up.min_rows > max_rows or rows.dtype not in (torch.float32, torch.bfloat16):
            max_rows = -1  # every expert padded past the kernel, or rows the kernels do not take
        buffers: dict[str, Any] = self._buffers  # `self.w13_q` is a Python call
        mid = self._grouped("w13", rows, counts, 2 * self.intermediate_size, amx_min_rows,
                            max_rows, buffers)  # fmt: skip
        act = silu_and_mul(mid, self.intermediate_size)
        out = self._grouped("w2", act, counts, self.hidden_size, amx_min_rows, max_rows, buffers)
        start = 0
        for mlp, count in zip(self.mlps, counts, strict=True):
            if count > max(max_rows, 0):  # left out of the grouped calls: its own layers
                out[start : start + count] = mlp.forward(rows[start : start + count])
            start += count
        return out

    def _grouped(self, proj: str, x: torch.Tensor, counts: list[int], n: int,
                 amx_min_rows: int, max_rows: int, buffers: dict[str, Any]) -> torch.Tensor:  # fmt: skip
        if self.kind == "int8":
            out: torch.Tensor = self.kernel.grouped_int8_linear(
                x, buffers[f"{proj}_q"], buffers[f"{proj}_scale"], counts, n, amx_min_rows,
                max_rows,
            )  # fmt: skip
            return out
        pairs = self.pairs[0][0].pairs
        out = self.kernel.grouped_int4_linear(
            x, buffers[f"{proj}_packed"], buffers[f"{proj}_scales_zeros"], counts, n, pairs,
            amx_min_rows, max_rows,
        )  # fmt: skip
        return out


def _kernel_kind(module: Any) -> str | None:
    """ "int8" or "int4" for a bias-free `QuantizedLinear` on duet's CPU kernels, else None."""
    if type(module) is not QuantizedLinear or module.bias is not None:
        return None
    if module.duet_kernels is None or not module.use_kernel or module.use_triton:
        return None
    return "int4" if module.kind == "int4" else "int8"


def _layer(expert: nn.Module, name: str) -> QuantizedLinear:
    layer = expert.get_submodule(name)
    assert isinstance(layer, QuantizedLinear)
    return layer


def _buffer(layer: QuantizedLinear, name: str) -> torch.Tensor:
    buffer = layer._buffers[name]
    assert buffer is not None
    return buffer


def _signature(module: QuantizedLinear) -> tuple[Any, ...]:
    """What must agree between experts for one stacked call: shape, format and layout."""
    names = OPERANDS[_kernel_kind(module) or "int8"]
    operands = tuple((_buffer(module, n).shape, _buffer(module, n).dtype) for n in names)
    return (module.kind, module.in_features, module.out_features, module.group_size,
            module.pairs, module.amx, module.duet_kernels, operands)  # fmt: skip
