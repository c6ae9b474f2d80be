"""A sparse layer's routed experts on the CPU as grouped products on duet's dense kernel
(engine/kernels/grouped_linear_cpu.cpp): the step's rows, sorted by expert, take one kernel
call for every expert's gate|up product, one pass of SiLU(gate) * up, and one call for every
down product, instead of a Python-driven product pair per expert.

Every element is the dense kernel's one chain of FMAs in k order (dense_linear_cpu.cpp), so a
token's expert outputs do not depend on which other tokens its experts received, at any row
count: batch-invariant by construction, in every mode (docs/determinism.md), with no padding
and no probe. Dense fp32 and bf16 experts only; quantized experts keep their per-expert
kernels, and on a CPU with AMX, bf16 experts keep the per-expert AMX tiles (`pack_dense`
packs column pairs there, which the grouped call does not take). On AVX512-BF16 without AMX
(AMD Zen 4), bf16 experts are packed as the same pairs and the grouped call runs
`vdpbf16ps` on them (engine/kernels/dense_dot.h): one order per element again, at twice the
fp32 FMAs' rate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from duet.engine.model.dense_cpu_linear import DTYPES
from duet.engine.model.mlp import silu_and_mul
from duet.engine.model.row_invariant import Linear


class CpuGroupedExperts(nn.Module):
    """Every local expert's gate|up and down weights as the dense kernel's panels, stacked:
    `w13` [E, tiles, hidden, tile] of each [2 I, hidden] gate|up weight, `w2` [E, tiles, I,
    tile] of each [hidden, I] down weight. Build with `from_experts`."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, intermediate_size: int,
                 hidden_size: int, kernel: Any) -> None:  # fmt: skip
        super().__init__()
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        self.intermediate_size = intermediate_size
        self.hidden_size = hidden_size
        self.num_experts = w13.shape[0]
        self.kernel = kernel

    @classmethod
    def from_experts(cls, experts: nn.ModuleList, kernel: Any) -> CpuGroupedExperts | None:
        """The panels of `experts` (MLPs of plain dense `Linear`s, fp32 or bf16, on the CPU,
        none on a kernel yet); None when they are not all such, or the kernel packs AMX
        pairs for them. Leaves `experts` as they are (the caller drops them)."""
        gate_ups = plain_weights([getattr(e, "gate_up_proj", None) for e in experts])
        downs = plain_weights([getattr(e, "down_proj", None) for e in experts])
        if not gate_ups or not downs:
            return None
        w13, w2 = stacked_panels(gate_ups, kernel), stacked_panels(downs, kernel)
        if w13 is None or w2 is None:
            return None
        hidden, intermediate = downs[0].shape  # [hidden, I]
        return cls(w13, w2, intermediate, hidden, kernel)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`rows` [S, hidden] sorted by expert, `counts[e]` of local expert e: each row's
        expert output [S, hidden]."""
        params: dict[str, Any] = self._parameters  # `self.w13` is a Python call
        gate_up = self.kernel.grouped_dense_linear(
            rows, params["w13"], counts, 2 * self.intermediate_size
        )  # [S, 2 I]
        act = silu_and_mul(gate_up, self.intermediate_size)
        return self.kernel.grouped_dense_linear(act, params["w2"], counts, self.hidden_size)


def plain_weights(modules: list[Any]) -> list[torch.Tensor] | None:
    """Each module's weight, where every one is a dense `Linear` (not quantized, not packed,
    not on a kernel, no bias) the kernel can take; else None."""
    weights: list[torch.Tensor] = []
    for module in modules:
        if type(module) is not Linear or module.cpu_kernel is not None or module.bias is not None:
            return None
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype not in DTYPES or not weight.is_contiguous():
            return None
        weights.append(weight)
    return weights


def stacked_panels(weights: list[torch.Tensor], kernel: Any) -> torch.Tensor | None:
    """[E, tiles, K, tile]: each weight's panels ([E, blocks, K / 2, 16, 2]: pairs for
    AVX512-BF16's dot), or None where they are AMX pairs."""
    first = kernel.pack_dense(weights[0])
    if first.dim() != 3 and not kernel.bf16_dot():
        return None
    out = first.new_empty(len(weights), *first.shape)
    out[0] = first
    for e in range(1, len(weights)):
        out[e] = kernel.pack_dense(weights[e])
    return out
