"""`TransferCollector`: the KV transfers of a router's `TransferLog` (cluster/transfer_log.py) as
Prometheus metrics, read at scrape time: `duet:kv_transfers`, `duet:kv_transfer_failures`,
`duet:request_migrations`, `duet:kv_transfer_bytes`, `duet:kv_transfers_in_flight`, the
duration, bandwidth and link-fraction histograms and the probed link rates
(docs/observability.md)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from duet.cluster.transfer_log import (
    BANDWIDTH_BUCKETS_GBPS,
    DURATION_BUCKETS_S,
    LINK_FRACTION_BUCKETS,
    TransferLog,
)


class TransferCollector(Collector):
    """`duet:kv_transfer_*`, `duet:kv_link_bandwidth_gbps` and `duet:request_migrations` from
    a `TransferLog`."""

    def __init__(self, log: TransferLog, model_name: str) -> None:
        self._log = log
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        log, labels = self._log, self._labels
        total = CounterMetricFamily(
            "duet:kv_transfers", "KV transfers that ended, by outcome.",
            labels=["model_name", "outcome"],
        )  # fmt: skip
        for status in ("done", "failed", "aborted", "cancelled"):
            total.add_metric([*labels, status], log.num_transfers[status])
        yield total
        failures = CounterMetricFamily(
            "duet:kv_transfer_failures", "Failed KV transfers by reason.",
            labels=["model_name", "reason"],
        )  # fmt: skip
        for reason, n in sorted(log.num_failures.items()):
            failures.add_metric([*labels, reason], n)
        yield failures
        migrations = CounterMetricFamily(
            "duet:request_migrations",
            "Request attempts moved to another worker (failovers, retries), by cause.",
            labels=["model_name", "cause"],
        )
        for cause, n in sorted(log.num_migrations.items()):
            migrations.add_metric([*labels, cause], n)
        yield migrations
        num_bytes = CounterMetricFamily(
            "duet:kv_transfer_bytes", "KV bytes moved by completed transfers.",
            labels=["model_name"],
        )  # fmt: skip
        num_bytes.add_metric(labels, log.num_bytes)
        yield num_bytes
        in_flight = GaugeMetricFamily(
            "duet:kv_transfers_in_flight", "KV transfers started and not ended.",
            labels=["model_name"],
        )  # fmt: skip
        in_flight.add_metric(labels, log.num_in_flight)
        yield in_flight
        yield _histogram(
            "duet:kv_transfer_duration_seconds",
            "Time from a request's prefill end to the decode side's acknowledgement of its KV.",
            labels, DURATION_BUCKETS_S, log.duration_counts, log.duration_sum_s,
        )  # fmt: skip
        yield _histogram(
            "duet:kv_transfer_bandwidth_gbps",
            "Achieved bandwidth of completed KV transfers (GB/s).",
            labels, BANDWIDTH_BUCKETS_GBPS, log.bandwidth_counts, log.bandwidth_sum_gbps,
        )  # fmt: skip
        link = GaugeMetricFamily(
            "duet:kv_link_bandwidth_gbps",
            "The rate of the KV link from a prefill worker to a decode worker as the sender's "
            "probe measured it (GB/s; the latest reported).",
            labels=["model_name", "source", "destination"],
        )
        for (source, destination), gbps in sorted(log.link_gbps.items()):
            link.add_metric([*labels, source, destination], gbps)
        yield link
        yield _histogram(
            "duet:kv_transfer_link_fraction",
            "Achieved bandwidth of completed KV transfers over their link's probed rate.",
            labels, LINK_FRACTION_BUCKETS, log.link_fraction_counts, log.link_fraction_sum,
        )  # fmt: skip


def _histogram(
    name: str,
    doc: str,
    labels: list[str],
    bounds: tuple[float, ...],
    counts: list[int],
    total: float,
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    cumulative, buckets = 0, []
    for bound, n in zip([*map(str, bounds), "+Inf"], counts, strict=True):
        cumulative += n
        buckets.append((bound, cumulative))
    family.add_metric(labels, buckets, total)
    return family
