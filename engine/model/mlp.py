"""The dense feed-forward: `MLP` (SiLU(gate) * up, then down, gate|up fused at load), its
projections (`make_linear`: dense or quantized) and a tensor-parallel rank's share of its
intermediate size (`mlp_shard`). A dense layer's feed-forward, and each expert of a mixture
(engine/model/moe.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from duet.engine.errors import InvalidInputError
from duet.engine.kernels import fused_ops_for
from duet.engine.model.quantized_linear import QuantizedLinear
from duet.engine.model.row_invariant import Linear
from duet.engine.parallel import TensorParallel
from duet.engine.quant.config import QuantizationConfig


def make_linear(
    in_features: int, out_features: int, bias: bool, quant: QuantizationConfig | None
) -> nn.Module:
    """A projection: dense, or a `QuantizedLinear` that the loader fills (no dense copy)."""
    if quant is None:
        return Linear(in_features, out_features, bias=bias)
    return QuantizedLinear(in_features, out_features, bias, quant)


class MLP(nn.Module):
    """SiLU(gate) * up, then down: a dense layer's feed-forward (`reduce`: its all-reduce), or
    one expert of a mixture (engine/model/moe.py, whose block reduces once for all)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallel,
        quant: QuantizationConfig | None = None,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.reduce = reduce
        start, end = mlp_shard(intermediate_size, tp)
        self.intermediate_size = end - start
        self.gate_up_proj = make_linear(hidden_size, 2 * self.intermediate_size, False, quant)
        self.down_proj = make_linear(self.intermediate_size, hidden_size, False, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts: dict[str, Any] = self._modules  # see DecoderLayer.forward
        gate_up = parts["gate_up_proj"].forward(x)  # [T, 2 I]
        out = parts["down_proj"].forward(silu_and_mul(gate_up, self.intermediate_size))
        return self.tp.all_reduce(out) if self.reduce else out


def mlp_shard(intermediate_size: int, tp: TensorParallel) -> tuple[int, int]:
    """This rank's [start, end) of the intermediate size: even where it divides, else in
    whole units of the largest power of two up to 128 that leaves every rank some (so
    quantization groups of up to that many input columns of down_proj stay whole)."""
    n = tp.world_size
    for exact in (True, False):
        for align in (128, 64, 32, 16, 8, 4, 2, 1):
            units = intermediate_size // align
            if intermediate_size % align or units < n or (exact and units % n):
                continue
            return tp.split(intermediate_size, align)
    raise InvalidInputError(
        "tensor_parallel_size",
        f"must be at most the model's intermediate_size ({intermediate_size}); got {n}",
    )


def silu_and_mul(gate_up: torch.Tensor, intermediate_size: int) -> torch.Tensor:
    """SiLU(gate) * up of `gate_up` [T, 2 I] (gate half first): the device's fused kernel in one
    pass where there is one (on the CPU written over the gate half: a [T, I] view), else torch."""
    kernels = fused_ops_for(gate_up)
    if kernels is not None:
        act: torch.Tensor = kernels.silu_and_mul(gate_up)
        return act
    gate, up = gate_up.split(intermediate_size, dim=-1)
    return F.silu(gate) * up
