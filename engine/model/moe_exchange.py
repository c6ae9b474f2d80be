"""Expert parallelism beyond the tensor-parallel size: a mixture's routed experts exchanged by
all-to-all between ranks whose attention is data-parallel (issue 44).

Under data-parallel attention each rank of an exchange group runs attention, the dense layers
and the router on its own tokens (its own requests and KV cache), and holds a contiguous
1/size of the routed experts whole. A sparse layer on rank r (`exchanged_experts`):

1. routes its own T_r tokens (the router is whole on every rank) and sorts its (token, choice)
   slots by expert; a rank's experts are contiguous, so each destination's slots are one run;
2. dispatch: each rank's per-expert counts go to the experts' owners (an all-to-all of size x
   E / size integers), then the slots' hidden rows (an all-to-all of rows);
3. the owner computes its experts over what it received, grouped by expert (stably: source
   rank order, then each source's slot order), one grouped call as on a single rank;
4. combine: each result goes back to the rank its row came from (the reverse all-to-all);
5. each rank scales and adds its tokens' k results in choice order, as `grouped_experts` does.

A rank with no tokens in a step must still take part (others may route rows to its experts):
its layer runs with zero rows. Every expert row's product is batch-invariant (duet's grouped
kernels and row-invariant linears compute a row the same whatever else is in the call) and the
adds keep their order, so a token's output has the same bits as on one rank holding every
expert (tests/engine/test_moe_exchange.py).

The all-to-alls are torch.distributed's (`all_to_all_single` with split sizes: gloo on the
CPU, NCCL on CUDA), under the group's timeout (a dead peer fails the step instead of hanging
it). What moves per layer is each token's k hidden rows out and k result rows back, against
an all-reduce of all T rows over every rank when attention is tensor-parallel
(docs/parallelism.md#expert-parallelism).
"""

from __future__ import annotations

from typing import Any

import torch

from duet.engine.model.moe_combine import combine_choices, expert_outputs
from duet.engine.parallel import ExpertExchange


def exchanged_experts(
    x: torch.Tensor,  # [T, hidden]: this rank's tokens (T may be 0)
    experts: Any,  # this rank's experts: an nn.ModuleList of MLPs or a grouped CPU module
    weights: torch.Tensor,  # [T, k], fp32
    ids: torch.Tensor,  # [T, k], ascending per row
    weights_in_model_dtype: bool,
    num_experts: int,
    exchange: ExpertExchange,
    counts_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum over each token's k experts of weight * expert(token), [T, hidden] in `x`'s dtype,
    the experts anywhere in the group (the module docstring's steps). `counts_into`
    ([num_experts] int64): this rank's (token, choice) pairs per expert are added to it."""
    top_k = ids.shape[1]
    size = exchange.size
    per_rank = num_experts // size
    flat = ids.reshape(-1)  # [T k]
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, so by owner rank
    counted = torch.bincount(flat, minlength=num_experts)  # [E]
    if counts_into is not None:
        counts_into.add_(counted)
    # Dispatch: the counts (row s of what arrives: source s's rows for each of my experts),
    # then the rows themselves.
    arrived = exchange.all_to_all(counted.view(size, per_rank), [1] * size, [1] * size)
    send = counted.view(size, per_rank).sum(1).tolist()
    receive = arrived.sum(1).tolist()
    rows = exchange.all_to_all(x.index_select(0, order // top_k), send, receive)
    # Compute: the received rows grouped by expert, stably, one grouped call.
    local_ids = torch.arange(per_rank, device=flat.device).repeat(size)
    by_expert = torch.argsort(torch.repeat_interleave(local_ids, arrived.view(-1)), stable=True)
    counts = arrived.sum(0).tolist()
    out_sorted = expert_outputs(experts, rows.index_select(0, by_expert), counts)
    results = torch.empty_like(out_sorted).index_copy_(0, by_expert, out_sorted)
    # Combine: each result back to its rank, in that rank's slot order (`order`).
    y = exchange.all_to_all(results, receive, send)  # [T k, hidden]
    return combine_choices(y, order, weights, weights_in_model_dtype, x, top_k)
