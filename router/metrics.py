"""Prometheus metrics under vLLM's names with a `duet:` prefix, one registry per app.

Latencies and token counters are recorded by the router as outputs pass through; engine
gauges (running, waiting, KV usage, prefix-cache hit rate) are read from `EngineStats` at
scrape time, so they cost nothing between scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine import RequestOutput
from engine.spec_decode.speculator import SpecDecodeStats
from router.engine_client import EngineClient

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class EngineStatsCollector(Collector):
    """Engine gauges and prefix-cache counters, read from `EngineStats` on each scrape."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self._engine = engine
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats
        gauges = (
            ("duet:num_requests_running", "Sequences in the engine's running batch.",
             stats.num_running),
            ("duet:num_requests_waiting", "Sequences waiting in the engine's queue.",
             stats.num_waiting),
            ("duet:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
             stats.kv_usage),
            ("duet:prefix_cache_hit_rate", "Prefix-cache hits per query since start.",
             stats.prefix_cache_hits / stats.prefix_cache_queries
             if stats.prefix_cache_queries else 0.0),
        )  # fmt: skip
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(self._labels, float(value))
            yield gauge
        cluster = getattr(self._engine, "cluster_stats", None)  # disaggregated mode only
        if cluster is not None:
            for name, doc, value in (
                ("duet:num_prefill_workers", "Healthy prefill workers (TP groups).",
                 cluster.num_prefill_workers),
                ("duet:num_decode_workers", "Healthy decode workers.", cluster.num_decode_workers),
                ("duet:prefill_queued_tokens",
                 "Prompt tokens queued or being prefilled across prefill workers.",
                 cluster.prefill_queued_tokens),
                ("duet:decode_batch_occupancy",
                 "Running and KV-waiting decode sequences over decode capacity (0..1).",
                 cluster.decode_batch_occupancy),
            ):  # fmt: skip
                gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
                gauge.add_metric(self._labels, float(value))
                yield gauge
        for name, doc, value in (
            ("duet:prefix_cache_queries", "Prefix-cache lookups (blocks).",
             stats.prefix_cache_queries),
            ("duet:prefix_cache_hits", "Prefix-cache hits (blocks).", stats.prefix_cache_hits),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(self._labels, float(value))
            yield counter
        if stats.spec_decode is not None:
            yield from _spec_decode_metrics(stats.spec_decode, self._labels)


def _spec_decode_metrics(spec: SpecDecodeStats, labels: list[str]) -> Iterator[Metric]:
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


class ServingMetrics:
    """The metrics of one app. Recording methods are called from the event loop's thread."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry
        self.ttft_s = Histogram(
            "duet:time_to_first_token_seconds", "Time from arrival to the first token.",
            labels, buckets=TTFT_BUCKETS_S, registry=reg,
        ).labels(model_name)  # fmt: skip
        self.itl_s = Histogram(
            "duet:inter_token_latency_seconds", "Time between successive outputs of a request.",
            labels, buckets=ITL_BUCKETS_S, registry=reg,
        ).labels(model_name)  # fmt: skip
        self.e2e_s = Histogram(
            "duet:e2e_request_latency_seconds", "Time from arrival to the last token.",
            labels, buckets=E2E_BUCKETS_S, registry=reg,
        ).labels(model_name)  # fmt: skip
        self.num_prompt_tokens = Counter(
            "duet:prompt_tokens", "Prompt tokens of requests that started generating.",
            labels, registry=reg,
        ).labels(model_name)  # fmt: skip
        self.num_generation_tokens = Counter(
            "duet:generation_tokens", "Tokens generated.", labels, registry=reg
        ).labels(model_name)
        self._success = Counter(
            "duet:request_success", "Finished sequences by finish reason.",
            [*labels, "finished_reason"], registry=reg,
        )  # fmt: skip
        self._model_name = model_name
        reg.register(EngineStatsCollector(engine, model_name))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def track(self, arrival_s: float) -> RequestMetrics:
        return RequestMetrics(self, arrival_s)

    def count_finished(self, reason: str) -> None:
        self._success.labels(self._model_name, reason).inc()


class RequestMetrics:
    """Latencies and token counts of one request, fed its outputs as they stream."""

    def __init__(self, metrics: ServingMetrics, arrival_s: float) -> None:
        self._m = metrics
        self._arrival_s = arrival_s
        self._last_token_s: float | None = None
        self._done = False

    def on_output(self, out: RequestOutput) -> None:
        num_new = sum(len(c.delta_token_ids) for c in out.outputs)
        if not num_new:
            return
        now = time.monotonic()
        if self._last_token_s is None:
            self._m.ttft_s.observe(now - self._arrival_s)
            self._m.num_prompt_tokens.inc(len(out.prompt_token_ids))
        else:
            self._m.itl_s.observe(now - self._last_token_s)
        self._last_token_s = now
        self._m.num_generation_tokens.inc(num_new)

    def on_finish(self, last: RequestOutput | None) -> None:
        """Record the end of the request (finished, failed or aborted). Idempotent."""
        if self._done:
            return
        self._done = True
        self._m.e2e_s.observe(time.monotonic() - self._arrival_s)
        if last is not None:
            for c in last.outputs:
                self._m.count_finished(c.finish_reason or "abort")
