"""The two ends of a mixture's routed experts that `moe.grouped_experts` (every token here) and
`moe_exchange.exchanged_experts` (the rows exchanged between ranks) share: running a rank's
experts over rows grouped by expert (`expert_outputs`), and putting each result back at its
(token, choice) slot, scaled by its routing weight, with each token's k results added in choice
order (`combine_choices`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from duet.engine.kernels.cpu import kernels_for


def expert_outputs(experts: Any, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each row through its expert: `rows` grouped by expert, counts[e] rows for local expert
    e; the outputs in the same order. `experts`: one grouped module (one call for all), or an
    nn.ModuleList of MLPs (a product pair per expert with rows)."""
    if not isinstance(experts, nn.ModuleList):
        out: torch.Tensor = experts.forward(rows, counts)
        return out
    out = torch.empty_like(rows)
    start = 0
    modules: dict[str, Any] = experts._modules  # `experts[e]` is a Python call per expert
    for e, count in enumerate(counts):
        if count:
            out[start : start + count] = modules[str(e)].forward(rows[start : start + count])
            start += count
    return out


def combine_choices(
    y: torch.Tensor,  # [slots, hidden]: the result of slot order[i] in row i
    order: torch.Tensor,  # [slots]: (token, choice) slots, token * k + choice
    weights: torch.Tensor,  # [T, k], fp32
    weights_in_model_dtype: bool,
    x: torch.Tensor,  # [T, hidden]: the tokens (their count, width and dtype)
    top_k: int,
) -> torch.Tensor:
    """[T, hidden] in `x`'s dtype: per token the sum over its k choices of weight * result, in
    choice order, one rounding per add (HF's loop of `index_add_`); a slot with no row (another
    expert-parallel rank's expert) adds zero. On the CPU duet's `moe_combine` does the scaling,
    the scatter and the adds in one pass, bit for bit the torch path."""
    num_tokens, hidden = x.shape
    scale = weights.reshape(-1, 1).index_select(0, order)  # [slots, 1]
    if weights_in_model_dtype:
        scale = scale.to(x.dtype)
    kernels = kernels_for(y)
    if kernels is not None:
        combined: torch.Tensor = kernels.moe_combine(y, order, scale.view(-1), num_tokens, top_k)
        return combined
    every_slot = order.shape[0] == num_tokens * top_k
    out = (x.new_empty if every_slot else x.new_zeros)(num_tokens * top_k, hidden)
    out.index_copy_(0, order, (y * scale).to(x.dtype))
    out = out.view(num_tokens, top_k, hidden)  # (hidden given: T may be 0)
    total = out[:, 0]
    for k in range(1, top_k):
        total = total + out[:, k]
    return total
