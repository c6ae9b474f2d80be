"""Speculative decoding's counters in /metrics, read from `EngineStats.spec_decode`."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from duet.engine.spec_decode.speculator import SpecDecodeStats
from duet.engine.stats import EngineStats
from duet.router.metrics import EngineStatsCollector


def _render(stats: EngineStats) -> str:
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(SimpleNamespace(stats=stats), "m"))  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def test_spec_decode_counters_and_acceptance_rate():
    spec = SpecDecodeStats(num_drafts=7, num_draft_tokens=20, num_accepted_tokens=15,
                           num_accepted_tokens_per_pos=[7, 5, 3])  # fmt: skip
    text = _render(EngineStats(spec_decode=spec))
    for line in (
        'duet:spec_decode_num_drafts_total{model_name="m"} 7.0',
        'duet:spec_decode_num_draft_tokens_total{model_name="m"} 20.0',
        'duet:spec_decode_num_accepted_tokens_total{model_name="m"} 15.0',
        'duet:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 7.0',
        'duet:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 3.0',
        'duet:spec_decode_acceptance_rate{model_name="m"} 0.75',
    ):
        assert line in text.splitlines()


def test_no_spec_decode_metrics_without_speculation():
    assert "spec_decode" not in _render(EngineStats())
