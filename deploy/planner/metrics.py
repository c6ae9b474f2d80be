"""The routers' Prometheus metrics, turned into the load signals the policy reads.

Latency percentiles come from histogram bucket deltas between two scrapes of the same router
(so they describe the last interval, not the whole uptime), summed over routers, then
interpolated inside the bucket like PromQL's `histogram_quantile`. Gauges that describe the
whole cluster (`duet:prefill_queued_tokens`, `duet:decode_batch_occupancy`, worker counts)
are reported by every router alike, so they are combined with max, never summed; per-router
gauges (`duet:num_requests_waiting`) are summed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

TTFT = "duet:time_to_first_token_seconds"
TPOT = "duet:inter_token_latency_seconds"
E2E = "duet:e2e_request_latency_seconds"
PREFILL_QUEUED_TOKENS = "duet:prefill_queued_tokens"
DECODE_BATCH_OCCUPANCY = "duet:decode_batch_occupancy"
NUM_PREFILL_WORKERS = "duet:num_prefill_workers"
NUM_DECODE_WORKERS = "duet:num_decode_workers"
NUM_REQUESTS_WAITING = "duet:num_requests_waiting"

HISTOGRAMS = (TTFT, TPOT, E2E)
CLUSTER_GAUGES = (
    PREFILL_QUEUED_TOKENS,
    DECODE_BATCH_OCCUPANCY,
    NUM_PREFILL_WORKERS,
    NUM_DECODE_WORKERS,
)
ROUTER_GAUGES = (NUM_REQUESTS_WAITING,)


class MetricsError(ValueError):
    """A scrape could not be parsed or lacks a metric the planner needs."""


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts: `counts[i]` observations were <= `bounds[i]`.

    Invariant: `bounds` ascend and end with +Inf; `counts` do not decrease.
    """

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def minus(self, earlier: Histogram) -> Histogram:
        """Observations made since `earlier`. A router restart (counts went down, or the
        buckets changed) means everything now counted is new."""
        if earlier.bounds != self.bounds or any(
            now < before for now, before in zip(self.counts, earlier.counts, strict=True)
        ):
            return self
        return Histogram(
            self.bounds,
            tuple(now - before for now, before in zip(self.counts, earlier.counts, strict=True)),
        )

    def plus(self, other: Histogram) -> Histogram:
        if other.bounds != self.bounds:
            raise MetricsError(f"histogram buckets differ: {self.bounds} vs {other.bounds}")
        return Histogram(
            self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        )

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 <= q <= 1), linearly interpolated inside its bucket; None
        without observations. A rank in the +Inf bucket gives the highest finite bound."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q: must be in [0, 1]; got {q}")
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        for i, (bound, cumulative) in enumerate(zip(self.bounds, self.counts, strict=True)):
            if cumulative >= rank:
                if math.isinf(bound):
                    return self.bounds[-2] if len(self.bounds) > 1 else None
                lower = self.bounds[i - 1] if i > 0 else 0.0
                below = self.counts[i - 1] if i > 0 else 0.0
                if cumulative == below:
                    return lower
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
        return None  # unreachable: the +Inf bucket holds every observation


@dataclass(frozen=True)
class RouterScrape:
    """One router's /metrics at one moment: histograms and gauges, each summed over its
    label sets (e.g. several served model names)."""

    histograms: Mapping[str, Histogram]
    gauges: Mapping[str, float]


def parse_scrape(text: str) -> RouterScrape:
    """Parse Prometheus text exposition into the histograms and gauges the planner uses."""
    buckets: dict[str, dict[tuple[tuple[str, str], ...], dict[float, float]]] = {}
    gauges: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise MetricsError(f"unparsable /metrics: {e}") from e
    for family in families:
        if family.name in HISTOGRAMS and family.type == "histogram":
            series = buckets.setdefault(family.name, {})
            for sample in family.samples:
                if sample.name != family.name + "_bucket":
                    continue
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
                series.setdefault(labels, {})[float(sample.labels["le"])] = sample.value
        elif family.name in CLUSTER_GAUGES + ROUTER_GAUGES:
            gauges[family.name] = sum(s.value for s in family.samples)
    histograms: dict[str, Histogram] = {}
    for name, series in buckets.items():
        total: Histogram | None = None
        for by_bound in series.values():
            bounds = tuple(sorted(by_bound))
            hist = Histogram(bounds, tuple(by_bound[b] for b in bounds))
            total = hist if total is None else total.plus(hist)
        if total is not None:
            histograms[name] = total
    return RouterScrape(histograms, gauges)


@dataclass(frozen=True)
class LoadSignals:
    """What the policy sees for one interval, across every router."""

    ttft_p90_s: float | None
    """p90 time to first token over the interval; None without observations."""
    tpot_p90_s: float | None
    """p90 inter-token latency (time per output token) over the interval."""
    num_ttft_samples: int
    num_tpot_samples: int
    prefill_queued_tokens: float
    decode_batch_occupancy: float
    num_prefill_workers: int
    num_decode_workers: int
    num_requests_waiting: int


def interval_signals(
    earlier: Mapping[str, RouterScrape], now: Mapping[str, RouterScrape]
) -> LoadSignals:
    """Signals for the interval between two scrape rounds, keyed by router address. A
    router seen only in `now` (new, or back after a failed scrape) contributes gauges but no
    latency deltas, since its histogram spans its whole uptime."""
    if not now:
        raise MetricsError("no router answered /metrics")
    deltas: dict[str, Histogram] = {}
    for router, scrape in now.items():
        before = earlier.get(router)
        if before is None:
            continue
        for name in (TTFT, TPOT):
            hist = scrape.histograms.get(name)
            if hist is None:
                raise MetricsError(f"{router}: /metrics has no histogram {name}")
            prev = before.histograms.get(name)
            delta = hist.minus(prev) if prev is not None else hist
            deltas[name] = delta if name not in deltas else deltas[name].plus(delta)

    def cluster_gauge(name: str) -> float:
        values = [s.gauges[name] for s in now.values() if name in s.gauges]
        if not values:
            raise MetricsError(f"no router reports the gauge {name}")
        return max(values)

    ttft, tpot = deltas.get(TTFT), deltas.get(TPOT)
    return LoadSignals(
        ttft_p90_s=ttft.quantile(0.9) if ttft else None,
        tpot_p90_s=tpot.quantile(0.9) if tpot else None,
        num_ttft_samples=int(ttft.count) if ttft else 0,
        num_tpot_samples=int(tpot.count) if tpot else 0,
        prefill_queued_tokens=cluster_gauge(PREFILL_QUEUED_TOKENS),
        decode_batch_occupancy=min(1.0, max(0.0, cluster_gauge(DECODE_BATCH_OCCUPANCY))),
        num_prefill_workers=int(cluster_gauge(NUM_PREFILL_WORKERS)),
        num_decode_workers=int(cluster_gauge(NUM_DECODE_WORKERS)),
        num_requests_waiting=int(
            sum(s.gauges.get(NUM_REQUESTS_WAITING, 0.0) for s in now.values())
        ),
    )
