"""`WorkerStatsCollector`: the workers' engine counters in a disaggregated router's /metrics,
summed over every worker process it has heard from (their load reports carry them,
`WorkerStats` in worker.proto): tokens per engine step (`duet:iteration_tokens_total`, vLLM's
`iteration_tokens_total`, prefill and decode steps alike) and the decode workers' speculative
decoding counters (`duet:spec_decode_*`, as an aggregated engine exports them), and for a
mixture of experts the tokens routed to each expert, summed over workers, and the largest of the
workers' last-step imbalances (`duet:moe_expert_*`)."""

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
        experts = sum_expert_load(reports)
        if experts is not None:
            yield from expert_load_metrics(*experts, self._labels)


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
    yield _per_index(
        "duet:spec_decode_num_accepted_tokens_per_pos",
        "Proposed tokens accepted at each position of a proposal (0 = first).",
        "position", spec.num_accepted_tokens_per_pos, labels,
    )  # fmt: skip
    yield _gauge(
        "duet:spec_decode_acceptance_rate",
        "Accepted over proposed tokens since start (0 before any proposal).",
        spec.acceptance_rate, labels,
    )  # fmt: skip


def _per_index(
    name: str, doc: str, index: str, values: Iterable[float], labels: list[str]
) -> CounterMetricFamily:
    """A counter with one series per position of `values`, labelled `index`."""
    family = CounterMetricFamily(name, doc, labels=["model_name", index])
    for i, value in enumerate(values):
        family.add_metric([*labels, str(i)], float(value))
    return family


def _gauge(name: str, doc: str, value: float, labels: list[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


def expert_load_metrics(tokens: list[int], imbalance: float, labels: list[str]) -> Iterator[Metric]:
    """A mixture of experts' load: (token, choice) pairs each routed expert received since
    start, summed over sparse layers, and the last step's imbalance (engine/model/expert_load.py)."""
    yield _per_index(
        "duet:moe_expert_tokens",
        "Tokens (token, choice pairs) routed to each expert, summed over MoE layers.",
        "expert", tokens, labels,
    )  # fmt: skip
    yield _gauge(
        "duet:moe_expert_imbalance",
        "The last step's max over mean tokens per expert, averaged over MoE layers (1 = even).",
        imbalance, labels,
    )  # fmt: skip


def sum_expert_load(reports: Iterable[worker_pb2.WorkerStats]) -> tuple[list[int], float] | None:
    """The workers' tokens per expert added up, and the largest of their last-step
    imbalances; None when no worker reported expert load (a dense model)."""
    tokens: list[int] | None = None
    worst = 0.0
    for r in reports:
        if not r.moe_expert_tokens:
            continue
        tokens = tokens or []
        tokens.extend([0] * (len(r.moe_expert_tokens) - len(tokens)))
        for i, n in enumerate(r.moe_expert_tokens):
            tokens[i] += n
        worst = max(worst, r.moe_expert_imbalance)
    return None if tokens is None else (tokens, worst)


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
