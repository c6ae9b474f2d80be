"""A worker's engine counters in its load report (`WorkerStats`, worker.proto), for the
router's /metrics: tokens per engine step, speculative decoding's counters and a mixture of
experts' expert load."""

from __future__ import annotations

from duet.engine.stats import EngineStats
from duet.v1 import worker_pb2


def worker_stats(stats: EngineStats) -> worker_pb2.WorkerStats:
    """`stats` (the engine thread's; read without a lock: a report may be a step behind)."""
    out = worker_pb2.WorkerStats(
        iteration_token_counts=list(stats.iteration_token_counts),
        iteration_tokens_sum=stats.iteration_tokens_sum,
    )
    spec = stats.spec_decode
    if spec is not None:
        out.speculating = True
        out.spec_num_drafts = spec.num_drafts
        out.spec_num_draft_tokens = spec.num_draft_tokens
        out.spec_num_accepted_tokens = spec.num_accepted_tokens
        out.spec_num_accepted_tokens_per_pos.extend(spec.num_accepted_tokens_per_pos)
    if stats.moe_expert_tokens is not None:
        out.moe_expert_tokens.extend(stats.moe_expert_tokens)
        out.moe_expert_imbalance = stats.moe_expert_imbalance
    return out
