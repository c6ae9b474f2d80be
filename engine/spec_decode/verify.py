"""Verification of proposed tokens against the target model.

Point-mass proposals (ngram: a token proposed with certainty, q = one-hot). vLLM's rejection
sampler accepts a proposed token d with probability min(1, p(d) / q(d)) = p(d) and, on
rejection, draws from the residual max(p - q, 0), which is p without d, renormalised. Here
every row of a speculating request is first drawn from the target exactly as a plain decode
would draw it (`Sampler`: same uniform for the same seed and position), and d is accepted iff
the draw equals d: P(accept) = p(d), and a rejection's token is p's draw conditioned on
!= d, the residual. Same distribution as vLLM's; in addition a seeded request's tokens are the
same with or without speculation, and greedy is the special case "accept iff d is the argmax,
then the argmax" (the longest prefix agreeing with the target plus one token of its own).

Proposals with a distribution (a draft model, later) go through `rejection_sample`, the
general rule on probability tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_point_mass(
    row_tokens: Sequence[int], drafts: Sequence[Sequence[int]]
) -> tuple[list[list[int]], list[int]]:
    """`row_tokens`: the target's draw at every sampling row (1 + len(draft) rows per request,
    in order). Returns each request's new tokens (the accepted proposed tokens, then the
    target's token at the first disagreement or after the last proposal) and the rows those
    tokens came from."""
    out: list[list[int]] = []
    kept_rows: list[int] = []
    row = 0
    for draft in drafts:
        tokens = []
        for j in range(len(draft) + 1):
            token = row_tokens[row + j]
            tokens.append(token)
            kept_rows.append(row + j)
            if j == len(draft) or token != draft[j]:
                break
        out.append(tokens)
        row += len(draft) + 1
    return out, kept_rows


def rejection_sample(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    accept_uniform: torch.Tensor,
    recover_uniform: torch.Tensor,
) -> tuple[list[int], int]:
    """Leviathan et al.'s rule, as vLLM's rejection sampler applies it, for one request.

    target_probs: [k + 1, V] the target's (processed) distribution at each proposed position
    and after the last; draft_ids: [k]; draft_probs: [k, V], or None for point masses;
    accept_uniform, recover_uniform: [k + 1] in (0, 1). Token j is accepted when
    u_j < p_j(d_j) / q_j(d_j); at the first rejection a token is drawn (inverse CDF with
    recover_uniform[j]) from max(p_j - q_j, 0) renormalised; with every token accepted, a bonus
    token is drawn from p_k. Returns (the new tokens, number of proposed tokens accepted)."""
    k = draft_ids.shape[0]
    out: list[int] = []
    for j in range(k):
        d = int(draft_ids[j])
        p = target_probs[j].double()
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        if q_d > 0 and float(accept_uniform[j]) < float(p[d]) / q_d:
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[j].double()).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # q covers p exactly: p itself is the residual
            residual = p
        out.append(_inverse_cdf(residual, float(recover_uniform[j])))
        return out, j
    out.append(_inverse_cdf(target_probs[k].double(), float(recover_uniform[k])))
    return out, k


def _inverse_cdf(weights: torch.Tensor, u: float) -> int:
    cdf = weights.cumsum(dim=-1)
    index = int(
        torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True)[0]
    )
    return min(index, weights.shape[-1] - 1)
