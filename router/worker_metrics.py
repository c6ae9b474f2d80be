"""`WorkerStatsCollector`: the workers' engine counters in a disaggregated router's /metrics,
summed over every worker process it has heard from (their load reports carry them,
`WorkerStats` in worker.proto): tokens per engine step (`duet:iteration_tokens_total`, vLLM's
`iteration_tokens_total`, prefill and decode steps alike) and the decode workers' speculative
decoding counters (`duet:spec_decode_*`, as an aggregated engine exports them)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from duet.cluster.worker_pool import WorkerPool
from duet.engine.spec_decode.speculator import SpecDecodeStats
from duet.engine.stats import ITERATION_TOKEN_BUCKETS
from duet.v1 import worker_pb2


class WorkerStatsCollector(Collector):
    def __init__(self, pool: WorkerPool, model_name: str) -> None:
        self._pool = pool
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        reports = list(self._pool.worker_stats.values())
        counts = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        total = 0
        for r in reports:
            if len(r.iteration_token_counts) == len(counts):
                counts = [a + b for a, b in zip(counts, r.iteration_token_counts, strict=True)]
                total += r.iteration_tokens_sum
        yield iteration_tokens_histogram(counts, total, self._labels)
        spec = sum_spec_decode(r for r in reports if r.speculating)
        if spec is not None:
            yield from spec_decode_metrics(spec, self._labels)


def iteration_tokens_histogram(counts: list[int], total: int, labels: list[str]) -> Metric:
    """vLLM's `iteration_tokens_total` from per-bucket (not cumulative) step counts."""
    family = HistogramMetricFamily(
        "duet:iteration_tokens_total", "Tokens computed per engine step.", labels=["model_name"]
    )
    cumulative, buckets = 0, []
    for bound, n in zip([*map(str, ITERATION_TOKEN_BUCKETS), "+Inf"], counts, strict=True):
        cumulative += n
        buckets.append((bound, cumulative))
    family.add_metric(labels, buckets, total)
    return family


def spec_decode_metrics(spec: SpecDecodeStats, labels: list[str]) -> Iterator[Metric]:
    """Speculative decoding's counters (vLLM's `spec_decode_*`) and the acceptance rate."""
    for name, doc, value in (
        ("duet:spec_decode_num_drafts", "Verifications of proposed tokens (request-steps).",
         spec.num_drafts),
        ("duet:spec_decode_num_draft_tokens", "Proposed tokens verified.", spec.num_draft_tokens),
        ("duet:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
         spec.num_accepted_tokens),
    ):  # fmt: skip
        counter = CounterMetricFamily(name, doc, labels=["model_name"])
        counter.add_metric(labels, float(value))
        yield counter
    per_pos = CounterMetricFamily(
        "duet:spec_decode_num_accepted_tokens_per_pos",
        "Proposed tokens accepted at each position of a proposal (0 = first).",
        labels=["model_name", "position"],
    )
    for pos, value in enumerate(spec.num_accepted_tokens_per_pos):
        per_pos.add_metric([*labels, str(pos)], float(value))
    yield per_pos
    rate = GaugeMetricFamily(
        "duet:spec_decode_acceptance_rate",
        "Accepted over proposed tokens since start (0 before any proposal).",
        labels=["model_name"],
    )
    rate.add_metric(labels, spec.acceptance_rate)
    yield rate


def sum_spec_decode(reports: Iterable[worker_pb2.WorkerStats]) -> SpecDecodeStats | None:
    """The speculating workers' counters added up (positions aligned); None without any."""
    out: SpecDecodeStats | None = None
    for r in reports:
        out = out or SpecDecodeStats()
        out.num_drafts += r.spec_num_drafts
        out.num_draft_tokens += r.spec_num_draft_tokens
        out.num_accepted_tokens += r.spec_num_accepted_tokens
        per_pos = out.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(r.spec_num_accepted_tokens_per_pos) - len(per_pos)))
        for i, n in enumerate(r.spec_num_accepted_tokens_per_pos):
            per_pos[i] += n
    return out
