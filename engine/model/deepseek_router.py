"""DeepSeek's routers, as HF transformers' `DeepseekV2TopkRouter` and `DeepseekV3TopkRouter`
compute them (on logits from the model's own gate product):

- V2: softmax scores; "greedy" takes each token's top k, "group_limited_greedy" first keeps the
  `topk_groups` groups whose best score is highest (the other experts' scores set to 0);
  the weights are the chosen scores times `routed_scaling_factor` (never renormalised).
- V3 ("noaux_tc"): sigmoid scores; `e_score_correction_bias` is added for the choice only:
  groups ranked by the sum of their two best biased scores, the top `topk_groups` kept (the
  rest -inf), the top k of the biased scores chosen; the weights are the unbiased scores of
  the chosen, divided by their sum (+1e-20) with `norm_topk_prob`, times
  `routed_scaling_factor`.

Each token's choices come back in ascending expert order, as `moe.route`'s do, for
`grouped_experts`. Every step is row-wise (a token's weights do not depend on its batch); the
sigmoid runs element by element on a strided copy, as `moe.sigmoid_rows` explains.
"""

from __future__ import annotations

import torch

from duet.engine.model.arch import MoEConfig
from duet.engine.model.row_invariant import elementwise


def route_deepseek(
    logits: torch.Tensor,  # [T, E], the gate's product
    moe: MoEConfig,
    correction_bias: torch.Tensor | None,  # [E] (V3), else None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]), each token's choices in ascending expert
    order."""
    x = logits.float()
    scores = elementwise(torch.sigmoid, x) if moe.scoring == "sigmoid" else torch.softmax(x, dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if moe.topk_method != "greedy":
        num_tokens, num_experts = choice.shape
        per_group = num_experts // moe.num_groups
        grouped = choice.view(num_tokens, moe.num_groups, per_group)
        if moe.topk_method == "noaux_tc":
            best = grouped.topk(2, dim=-1).values
            group_scores = best[..., 0] + best[..., 1]
        else:
            group_scores = grouped.amax(dim=-1)
        kept = group_scores.topk(moe.topk_groups, dim=-1).indices  # [T, topk_groups]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        fill = float("-inf") if moe.topk_method == "noaux_tc" else 0.0
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), fill)
    ids = choice.topk(moe.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    if moe.renormalize:
        total = weights[:, :1]
        for k in range(1, weights.shape[1]):  # in choice order, one column at a time
            total = total + weights[:, k : k + 1]
        weights = weights / (total + 1e-20)
    weights = weights * moe.routed_scaling_factor
    ids, order = ids.sort(dim=-1)
    return weights.gather(-1, order), ids
