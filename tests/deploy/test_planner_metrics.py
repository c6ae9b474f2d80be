"""The planner's metrics: parsing the routers' Prometheus text, percentiles from histogram
bucket deltas between two scrapes, and combining several routers."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client import Histogram as PromHistogram

from duet.deploy.planner.metrics import (
    TPOT,
    TTFT,
    Histogram,
    MetricsError,
    interval_signals,
    parse_scrape,
)
from tests.deploy.router_metrics import ITL_BUCKETS_S, TTFT_BUCKETS_S, RouterMetrics

INF = math.inf


def test_quantile_interpolates_inside_the_bucket():
    h = Histogram((0.1, 0.5, 1.0, INF), (10, 60, 90, 100))
    assert h.quantile(0.9) == pytest.approx(1.0)  # rank 90 ends bucket (0.5, 1.0]
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.4 * 40 / 50)
    assert h.quantile(0.05) == pytest.approx(0.05)  # first bucket interpolates from 0
    assert h.count == 100


def test_quantile_in_the_inf_bucket_is_the_highest_finite_bound():
    assert Histogram((0.1, 0.5, 1.0, INF), (0, 0, 50, 100)).quantile(0.9) == 1.0


def test_quantile_without_observations_is_none():
    assert Histogram((0.1, INF), (0, 0)).quantile(0.9) is None
    with pytest.raises(ValueError, match=r"q: must be in \[0, 1\]; got 1.5"):
        Histogram((0.1, INF), (1, 1)).quantile(1.5)


def test_delta_between_scrapes_and_counter_reset():
    before = Histogram((0.1, 1.0, INF), (5, 8, 10))
    after = Histogram((0.1, 1.0, INF), (5, 28, 30))
    assert after.minus(before) == Histogram((0.1, 1.0, INF), (0, 20, 20))
    # The router restarted: counts went down, so everything counted now is new.
    restarted = Histogram((0.1, 1.0, INF), (1, 2, 3))
    assert restarted.minus(before) == restarted


def test_parse_a_real_exposition():
    router = RouterMetrics()
    router.observe_ttft(0.03, 80)
    router.observe_ttft(0.3, 20)
    router.prefill_queued_tokens.set(4096)
    router.decode_batch_occupancy.set(0.5)
    router.num_prefill_workers.set(2)
    router.num_decode_workers.set(4)
    router.num_requests_waiting.set(3)
    scrape = parse_scrape(router.text())
    ttft = scrape.histograms[TTFT]
    assert ttft.bounds == (*TTFT_BUCKETS_S, INF)
    assert ttft.count == 100
    assert ttft.counts[TTFT_BUCKETS_S.index(0.04)] == 80
    assert ttft.counts[TTFT_BUCKETS_S.index(0.5)] == 100
    # p90: rank 90 lies 10 of 20 into the (0.25, 0.5] bucket.
    assert ttft.quantile(0.9) == pytest.approx(0.375)
    assert scrape.histograms[TPOT].count == 0
    assert dict(scrape.gauges) == {
        "duet:prefill_queued_tokens": 4096.0,
        "duet:decode_batch_occupancy": 0.5,
        "duet:num_prefill_workers": 2.0,
        "duet:num_decode_workers": 4.0,
        "duet:num_requests_waiting": 3.0,
    }


def test_label_sets_of_one_router_are_summed():
    # A router serving two model names exposes two series per metric.
    registry = CollectorRegistry()
    itl = PromHistogram(TPOT, "ITL", ["model_name"], buckets=ITL_BUCKETS_S, registry=registry)
    itl.labels("a").observe(0.02)
    for _ in range(4):
        itl.labels("b").observe(0.3)
    queued = Gauge("duet:prefill_queued_tokens", "q", ["model_name"], registry=registry)
    queued.labels("a").set(100)
    queued.labels("b").set(50)
    scrape = parse_scrape(generate_latest(registry).decode())
    assert scrape.histograms[TPOT].count == 5
    assert scrape.histograms[TPOT].quantile(0.2) == pytest.approx(0.025)
    assert scrape.gauges["duet:prefill_queued_tokens"] == 150


def test_unparsable_text_is_a_metrics_error():
    with pytest.raises(MetricsError, match="unparsable /metrics"):
        parse_scrape("duet:prefill_queued_tokens{model_name=} nope\n")


def _set_gauges(r: RouterMetrics, queued: float, occupancy: float, waiting: int) -> None:
    r.prefill_queued_tokens.set(queued)
    r.decode_batch_occupancy.set(occupancy)
    r.num_prefill_workers.set(2)
    r.num_decode_workers.set(4)
    r.num_requests_waiting.set(waiting)


def test_interval_signals_sum_router_deltas_and_combine_gauges():
    r1, r2 = RouterMetrics(), RouterMetrics()
    _set_gauges(r1, 1000, 0.6, 2)
    _set_gauges(r2, 1200, 0.62, 5)  # cluster gauges are read at slightly different moments
    r1.observe_ttft(5.0, 500)  # before the interval: must not count
    first = {"r1": parse_scrape(r1.text()), "r2": parse_scrape(r2.text())}
    r1.observe_ttft(0.03, 45)
    r2.observe_ttft(0.03, 45)
    r2.observe_ttft(0.3, 10)
    r1.observe_itl(0.02, 200)
    second = {"r1": parse_scrape(r1.text()), "r2": parse_scrape(r2.text())}
    s = interval_signals(first, second)
    assert s.num_ttft_samples == 100
    # 90 of 100 at <= 0.04 s: p90 is the top of the (0.02, 0.04] bucket.
    assert s.ttft_p90_s == pytest.approx(0.04)
    assert s.num_tpot_samples == 200
    assert s.tpot_p90_s == pytest.approx(0.01 + 0.015 * 0.9)  # inside (0.01, 0.025]
    assert s.prefill_queued_tokens == 1200  # max: every router sees the whole cluster
    assert s.decode_batch_occupancy == 0.62
    assert (s.num_prefill_workers, s.num_decode_workers) == (2, 4)
    assert s.num_requests_waiting == 7  # per-router queues add up


def test_a_router_without_a_baseline_adds_gauges_but_no_latency():
    old, new = RouterMetrics(), RouterMetrics()
    _set_gauges(old, 0, 0.1, 0)
    _set_gauges(new, 50_000, 0.9, 1)
    new.observe_ttft(9.0, 1000)  # its whole uptime, not this interval
    first = {"old": parse_scrape(old.text())}
    old.observe_ttft(0.03, 30)
    second = {"old": parse_scrape(old.text()), "new": parse_scrape(new.text())}
    s = interval_signals(first, second)
    assert s.num_ttft_samples == 30
    assert s.ttft_p90_s == pytest.approx(0.02 + 0.02 * 0.9)
    assert s.prefill_queued_tokens == 50_000


def test_first_round_has_gauges_and_no_percentiles():
    r = RouterMetrics()
    _set_gauges(r, 10, 0.2, 0)
    r.observe_ttft(1.0, 50)
    s = interval_signals({}, {"r": parse_scrape(r.text())})
    assert (s.ttft_p90_s, s.tpot_p90_s, s.num_ttft_samples) == (None, None, 0)
    assert s.prefill_queued_tokens == 10


def test_no_router_or_missing_gauge_is_a_metrics_error():
    with pytest.raises(MetricsError, match="no router answered"):
        interval_signals({}, {})
    r = RouterMetrics()
    with pytest.raises(MetricsError, match="no router reports the gauge duet:prefill_queued"):
        interval_signals({}, {"r": parse_scrape(r.text().replace("prefill_queued", "x"))})
