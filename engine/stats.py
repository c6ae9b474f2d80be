"""`EngineStats`: an engine's counters and gauges, read by `/metrics` at scrape time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.spec_decode.speculator import SpecDecodeStats

if TYPE_CHECKING:
    from engine.kv_cache_manager import KVCacheManager
    from engine.scheduler import Scheduler
    from engine.spec_decode.speculator import Speculator


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
