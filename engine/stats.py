"""`EngineStats`: an engine's counters and gauges, read by `/metrics` at scrape time."""

from __future__ import annotations

from dataclasses import dataclass

from engine.spec_decode.speculator import SpecDecodeStats


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
