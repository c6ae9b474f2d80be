"""`ConcatLinear`: a fused projection (q|k|v, gate|up) held as several layers side by side.

A GGUF file may store the parts of one fused layer in different formats: Q4_K_M files, the
most common GGUF release, keep `attn_q` and `attn_k` in Q4_K (duet's int4, groups of 32) and
`attn_v` in Q6_K (int8, groups of 16) in half of the layers. One kernel takes one format, so
each run of parts that share a format becomes its own layer (a `QuantizedLinear`, or a dense
row-invariant `Linear` for a part the file stores unquantized), and the outputs are
concatenated. Every row of the output is computed on its own by one of the layers, so the
result is as row-invariant as its layers (docs/determinism.md).
"""

from __future__ import annotations

import torch
from torch import nn


class ConcatLinear(nn.Module):
    """`y = [x @ W_0.T | x @ W_1.T | ...]`: output columns `offsets[i]` onward come from
    `layers[i]`."""

    def __init__(self, layers: list[nn.Module], in_features: int, out_features: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.in_features = in_features
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(x) for layer in self.layers], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
