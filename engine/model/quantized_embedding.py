"""A tied embedding read from its quantized LM head: one int8 or int4 table serves both.

A model whose LM head is its embedding table (SmolLM2) and whose head is quantized
(`quantize_lm_head`, or a GGUF head kept quantized) looks its tokens up in the head's own
quantized weight, as llama.cpp does with `token_embd`, instead of also keeping the table in
full precision. `gather_rows(head, ids, dtype)` gives exactly `head.dequantize(dtype)[ids]`
(the same elementwise operations on the gathered rows) without dequantizing the other rows: the
row of channel n sits in block n // 16, lane n % 16 of the kernels' layouts
(engine/quant/cpu_linear.py), or at row n of the Triton layouts.
"""

from __future__ import annotations

import torch

from duet.engine.model.quantized_linear import QuantizedLinear


def can_gather_rows(head: QuantizedLinear) -> bool:
    """Whether `head`'s layout can give single rows: duet's CPU kernels' and the Triton ones
    (not torch's opaque int4 packing, used only where duet's kernels cannot be built)."""
    return head.duet_kernels is not None or head.use_triton or head.kind.startswith("int8")


def gather_rows(head: QuantizedLinear, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` ([T], in [0, out_features)) of `head`'s dense weight, [T, in_features] of
    `dtype`: the embeddings of tokens `ids`."""
    ids = ids.long()
    t, k, g = ids.shape[0], head.in_features, head.group_size
    kernels = head.duet_kernels
    if kernels is not None:  # the CPU kernels' layouts (block n // 16, lane n % 16): one call
        out = torch.empty(t, k, dtype=dtype)
        if head.kind.startswith("int8"):
            kernels.int8_rows(head.q, head.scale, ids, out, head.pairs)
        else:
            kernels.int4_rows(head.packed, head.scales_zeros, ids, out, head.pairs)
        return out
    if head.kind.startswith("int8"):  # plain rows [N, K]
        q, scale = head.q[ids], head.scale[ids]
        groups = q.reshape(t, -1, g).to(scale.dtype)
        return (groups * scale.reshape(t, -1, 1)).view(t, k).to(dtype)
    if head.use_triton:  # rows: column 2j low nibble, 2j + 1 high
        packed = head.packed[ids]
        q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(t, k)
        groups = q.to(head.scale.dtype).view(t, -1, g)
        w = groups * head.scale[ids][..., None] + head.zero[ids][..., None]
        return w.view(t, k).to(dtype)
    raise ValueError("this int4 layout (torch's packing) cannot give single rows")
