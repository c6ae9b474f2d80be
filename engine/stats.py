"""`EngineStats`: an engine's counters and gauges, read by `/metrics` at scrape time."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from duet.engine.model.expert_load import imbalance
from duet.engine.spec_decode.speculator import SpecDecodeStats

if TYPE_CHECKING:
    from duet.engine.kv_cache_manager import KVCacheManager
    from duet.engine.scheduler import Scheduler
    from duet.engine.spec_decode.speculator import Speculator


ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Upper bounds of the tokens-per-step histogram (vLLM's `iteration_tokens_total`)."""


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding
    # Steps by tokens computed (ITERATION_TOKEN_BUCKETS, then +Inf; not cumulative), and the sum
    iteration_token_counts: list[int] = field(
        default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    )
    iteration_tokens_sum: int = 0
    step_seconds: float = 0.0
    """Wall time inside the engine's steps that ran a batch, summed: scheduling, the model
    runner, and turning its tokens into outputs."""
    execute_seconds: float = 0.0
    """Of `step_seconds`, the model runner's: inputs, forward, sampling and the one host
    transfer (on a GPU, the wait for the device). The rest is the engine's own host work."""
    # Mixtures of experts (None and 0.0 for a dense model; engine/model/expert_load.py):
    moe_expert_tokens: list[int] | None = None
    """(token, choice) pairs each routed expert received since start, summed over layers."""
    moe_expert_imbalance: float = 0.0
    """The last step's max over mean tokens per expert, averaged over sparse layers."""
    moe_layer_expert_tokens: list[list[int]] | None = None
    """`moe_expert_tokens` per sparse layer: [L][E]."""

    @classmethod
    def summed(cls, ranks: list[EngineStats]) -> EngineStats:
        """Data-parallel ranks' stats as one engine's (engine/data_parallel.py): counters,
        requests and histograms summed, KV usage and expert imbalance averaged over the ranks
        (each rank has its own pool and its own steps)."""
        out = cls()
        for name in ("num_steps", "num_prompt_tokens", "num_generated_tokens", "num_preemptions",
                     "prefix_cache_queries", "prefix_cache_hits", "num_running", "num_waiting",
                     "iteration_tokens_sum", "step_seconds", "execute_seconds"):  # fmt: skip
            setattr(out, name, sum(getattr(r, name) for r in ranks))
        out.kv_usage = sum(r.kv_usage for r in ranks) / len(ranks)
        out.iteration_token_counts = [
            sum(c) for c in zip(*(r.iteration_token_counts for r in ranks), strict=True)
        ]
        loads = [r.moe_layer_expert_tokens for r in ranks if r.moe_layer_expert_tokens is not None]
        if loads:
            out.moe_layer_expert_tokens = [
                [sum(e) for e in zip(*layer, strict=True)] for layer in zip(*loads, strict=True)
            ]
            out.moe_expert_tokens = [
                sum(col) for col in zip(*out.moe_layer_expert_tokens, strict=True)
            ]
            out.moe_expert_imbalance = sum(r.moe_expert_imbalance for r in ranks) / len(ranks)
        return out

    def observe_step(self, num_tokens: int) -> None:
        """A step computed `num_tokens` tokens (prompt chunks, decodes and proposed tokens)."""
        self.iteration_token_counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self.iteration_tokens_sum += num_tokens

    def observe_expert_load(self, counts: list[list[int]]) -> None:
        """The cumulative [L][E] counts after a step (`ExpertLoad.read`)."""
        last = self.moe_layer_expert_tokens
        step = (
            counts
            if last is None
            else [[a - b for a, b in zip(now, was, strict=True)]
                  for now, was in zip(counts, last, strict=True)]
        )  # fmt: skip
        self.moe_layer_expert_tokens = counts
        self.moe_expert_tokens = [sum(col) for col in zip(*counts, strict=True)]
        self.moe_expert_imbalance = imbalance(step)

    def refresh(
        self, scheduler: Scheduler, kv: KVCacheManager, speculator: Speculator | None
    ) -> None:
        """Read the gauges and counters the engine's parts keep (after each step)."""
        self.num_preemptions = scheduler.num_preemptions
        self.prefix_cache_queries = kv.prefix_stats.num_queries
        self.prefix_cache_hits = kv.prefix_stats.num_hits
        self.num_running = len(scheduler.running)
        self.num_waiting = len(scheduler.waiting)
        self.kv_usage = kv.pool.usage()
        if speculator is not None:
            self.spec_decode = speculator.stats
