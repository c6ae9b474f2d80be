"""Prometheus metrics under vLLM's names with a `duet:` prefix, one registry per app.

Latencies and token counters are recorded by the router as outputs pass through; engine
gauges (running, waiting, KV usage, prefix-cache hit rate) are read from `EngineStats` at
scrape time, so they cost nothing between scrapes. With the `vllm` prefix every metric is
exported a second time with `vllm:` in place of `duet:`, so vLLM's Grafana dashboard and
gateways that read vLLM's names work unmodified (docs/observability.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from duet.engine import RequestOutput, SamplingParams
from duet.router.engine_client import EngineClient
from duet.router.live_window import LiveWindow
from duet.router.transfer_metrics import TransferCollector
from duet.router.worker_metrics import (
    WorkerStatsCollector,
    expert_load_metrics,
    iteration_tokens_histogram,
    spec_decode_metrics,
)

METRICS_PREFIXES = ("duet", "vllm")
"""`--metrics-prefix` values: `vllm` adds a `vllm:` copy of every `duet:` metric."""

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000)  # fmt: skip


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
        # vLLM's name before 0.10, which older gateways (endpoint pickers) still read
        legacy = GaugeMetricFamily(
            "duet:gpu_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
            labels=["model_name"],
        )  # fmt: skip
        legacy.add_metric(self._labels, float(stats.kv_usage))
        yield legacy
        # vLLM's LoRA gauge, which the Gateway API inference extension's endpoint picker reads:
        # no adapters (duet serves none), the value the scrape's time, as vLLM sets it.
        lora = GaugeMetricFamily(
            "duet:lora_requests_info", "Running and waiting LoRA adapters (none) and max_lora.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )  # fmt: skip
        lora.add_metric(["0", "", ""], time.time())
        yield lora
        cache = cache_config(self._engine)
        if cache is not None:
            info = GaugeMetricFamily(
                "duet:cache_config_info", "The KV cache's configuration, in labels (value 1).",
                labels=["model_name", *cache],
            )  # fmt: skip
            info.add_metric([*self._labels, *cache.values()], 1.0)
            yield info
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
        aggregated = getattr(self._engine, "pool", None) is None  # else WorkerStatsCollector's
        counters: list[tuple[str, str, float]] = [
            ("duet:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("duet:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
             stats.prefix_cache_hits),
            ("duet:num_preemptions", "Sequences preempted (their KV freed, to be recomputed).",
             stats.num_preemptions),
        ]  # fmt: skip
        if aggregated:
            counters += [
                ("duet:engine_steps", "Engine steps that ran a batch.", stats.num_steps),
                ("duet:engine_step_seconds",
                 "Wall time inside those steps: scheduling, the model runner, outputs.",
                 stats.step_seconds),
                ("duet:engine_execute_seconds",
                 "Of the steps' time, the model runner's (on a GPU, with the wait for it).",
                 stats.execute_seconds),
            ]  # fmt: skip
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(self._labels, float(value))
            yield counter
        if aggregated:
            yield iteration_tokens_histogram(
                stats.iteration_token_counts, stats.iteration_tokens_sum, self._labels
            )
            if stats.moe_expert_tokens is not None:  # a mixture of experts
                yield from expert_load_metrics(
                    stats.moe_expert_tokens, stats.moe_expert_imbalance, self._labels
                )
        if stats.spec_decode is not None:
            yield from spec_decode_metrics(stats.spec_decode, self._labels)


def cache_config(engine: EngineClient) -> dict[str, str] | None:
    """The KV cache's block size, block count and prefix caching, as vLLM's `cache_config_info`
    labels: one engine's (aggregated), or the decode pool's block size and total blocks as the
    router last heard them (disaggregated; None until a decode worker reported)."""
    inner = getattr(engine, "engine", None)  # AsyncEngine -> LLMEngine
    if inner is not None and hasattr(inner, "num_blocks"):
        config = inner.config
        return {
            "block_size": str(config.block_size),
            "num_gpu_blocks": str(inner.num_blocks),
            "enable_prefix_caching": str(config.enable_prefix_caching),
        }
    pool = getattr(engine, "pool", None)
    decode = [d for d in pool.decode.values() if d.block_size] if pool is not None else []
    if not decode:
        return None
    return {
        "block_size": str(decode[0].block_size),
        "num_gpu_blocks": str(sum(d.num_blocks for d in decode)),
    }


class RenamedCollector(Collector):
    """Every metric of `source` again, with `duet:` replaced by `new_prefix:`."""

    def __init__(self, source: CollectorRegistry, new_prefix: str) -> None:
        self._source = source
        self._prefix = new_prefix + ":"

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            if not family.name.startswith("duet:"):
                continue
            renamed = Metric(self._rename(family.name), family.documentation, family.type)
            renamed.samples = [s._replace(name=self._rename(s.name)) for s in family.samples]
            yield renamed

    def _rename(self, name: str) -> str:
        return self._prefix + name.removeprefix("duet:")


class ServingMetrics:
    """The metrics of one app. Recording methods are called from the event loop's thread."""

    def __init__(self, engine: EngineClient, model_name: str, prefix: str = "duet") -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics_prefix: must be one of {METRICS_PREFIXES}; got {prefix!r}")
        self.registry = CollectorRegistry()
        self._exported = CollectorRegistry()
        self._exported.register(_Everything(self.registry))
        if prefix != "duet":
            self._exported.register(RenamedCollector(self.registry, prefix))
        labels = ["model_name"]
        reg = self.registry

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.ttft_s = histogram(
            "duet:time_to_first_token_seconds", "Time from arrival to the first token.",
            TTFT_BUCKETS_S,
        )  # fmt: skip
        self.itl_s = histogram(
            "duet:inter_token_latency_seconds", "Time between successive outputs of a request.",
            ITL_BUCKETS_S,
        )  # fmt: skip
        # vLLM's older name for the inter-token latency, which its Grafana dashboard plots
        self.tpot_s = histogram(
            "duet:time_per_output_token_seconds",
            "Time between successive outputs of a request (vLLM's older name for the "
            "inter-token latency).",
            ITL_BUCKETS_S,
        )
        self.request_tpot_s = histogram(
            "duet:request_time_per_output_token_seconds",
            "Per finished request: its decode time over its longest sample's tokens after the "
            "first.",
            ITL_BUCKETS_S,
        )
        self.e2e_s = histogram(
            "duet:e2e_request_latency_seconds", "Time from arrival to the last token.",
            E2E_BUCKETS_S,
        )  # fmt: skip
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
        phases = (
            ("queue", "Time from arrival until the request was admitted to the engine."),
            ("prefill", "Time from admission to the first token (prefill, and in a cluster the "
             "KV transfer)."),
            ("decode", "Time from the first token to the last."),
            ("inference", "Time from admission to the last token."),
        )  # fmt: skip
        self.phase_s = {
            phase: histogram(f"duet:request_{phase}_time_seconds", doc, E2E_BUCKETS_S)
            for phase, doc in phases
        }
        self.request_prompt_tokens = histogram(
            "duet:request_prompt_tokens", "Prompt length of finished requests (tokens).",
            TOKEN_BUCKETS,
        )  # fmt: skip
        self.request_generation_tokens = histogram(
            "duet:request_generation_tokens", "Tokens generated per finished request.",
            TOKEN_BUCKETS,
        )  # fmt: skip
        self.request_max_num_generation_tokens = histogram(
            "duet:request_max_num_generation_tokens",
            "The most tokens any one sample of a finished request generated.",
            TOKEN_BUCKETS,
        )
        self.request_params_max_tokens = histogram(
            "duet:request_params_max_tokens", "The max_tokens requests asked for.", TOKEN_BUCKETS
        )
        self._responses = Counter(
            "duet:http_responses", "HTTP responses by route and status class (2xx, 4xx, 429, 5xx).",
            [*labels, "route", "status"], registry=reg,
        )  # fmt: skip
        self._grpc_requests = Counter(
            "duet:grpc_requests", "Public gRPC API calls by method and final status code.",
            [*labels, "method", "code"], registry=reg,
        )  # fmt: skip
        self.window = LiveWindow()  # the dashboard's live plots
        self._model_name = model_name
        reg.register(EngineStatsCollector(engine, model_name))
        transfers = getattr(engine, "transfers", None)  # disaggregated mode only
        if transfers is not None:
            reg.register(TransferCollector(transfers, model_name))
        pool = getattr(engine, "pool", None)  # disaggregated mode only
        if pool is not None:
            reg.register(WorkerStatsCollector(pool, model_name))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (twice, under both prefixes, with
        the `vllm` prefix)."""
        return generate_latest(self._exported)

    def track(self, arrival_s: float, params: SamplingParams | None = None) -> RequestMetrics:
        """Start recording one request, admitted now, that arrived at `arrival_s`."""
        return RequestMetrics(self, arrival_s, params)

    def count_response(self, route: str, status: str) -> None:
        self._responses.labels(self._model_name, route, status).inc()

    def count_grpc(self, method: str, code: str) -> None:
        self._grpc_requests.labels(self._model_name, method, code).inc()

    def count_finished(self, reason: str) -> None:
        self._success.labels(self._model_name, reason).inc()


class _Everything(Collector):
    """All of a registry's metrics, for a second registry that adds renamed copies."""

    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        return iter(self._source.collect())


class RequestMetrics:
    """Latencies and token counts of one request, fed its outputs as they stream."""

    def __init__(
        self, metrics: ServingMetrics, arrival_s: float, params: SamplingParams | None
    ) -> None:
        self._m = metrics
        self._arrival_s = arrival_s
        self._admitted_s = time.monotonic()
        self._first_token_s: float | None = None
        self._last_token_s: float | None = None
        self._num_prompt_tokens = 0
        self._done = False
        metrics.phase_s["queue"].observe(max(0.0, self._admitted_s - arrival_s))
        if params is not None and params.max_tokens is not None:
            metrics.request_params_max_tokens.observe(params.max_tokens)

    def on_output(self, out: RequestOutput) -> None:
        num_new = sum(len(c.delta_token_ids) for c in out.outputs)
        if not num_new:
            return
        now = time.monotonic()
        if self._last_token_s is None:
            self._first_token_s = now
            self._num_prompt_tokens = len(out.prompt_token_ids)
            self._m.ttft_s.observe(now - self._arrival_s)
            self._m.window.observe_ttft(now - self._arrival_s)
            self._m.phase_s["prefill"].observe(now - self._admitted_s)
            self._m.num_prompt_tokens.inc(len(out.prompt_token_ids))
        else:
            self._m.itl_s.observe(now - self._last_token_s)
            self._m.tpot_s.observe(now - self._last_token_s)
            self._m.window.observe_itl(now - self._last_token_s)
        self._last_token_s = now
        self._m.num_generation_tokens.inc(num_new)
        self._m.window.count_tokens(num_new)

    def on_finish(self, last: RequestOutput | None) -> None:
        """Record the end of the request (finished, failed or aborted). Idempotent."""
        if self._done:
            return
        self._done = True
        now = time.monotonic()
        m = self._m
        m.e2e_s.observe(now - self._arrival_s)
        m.phase_s["inference"].observe(now - self._admitted_s)
        if self._first_token_s is not None and self._last_token_s is not None:
            m.phase_s["decode"].observe(self._last_token_s - self._first_token_s)
        if last is not None:
            for c in last.outputs:
                m.count_finished(c.finish_reason or "abort")
            lengths = [len(c.token_ids) for c in last.outputs] or [0]
            m.request_prompt_tokens.observe(len(last.prompt_token_ids))
            m.request_generation_tokens.observe(sum(lengths))
            m.request_max_num_generation_tokens.observe(max(lengths))
            decode_s = (self._last_token_s or 0.0) - (self._first_token_s or 0.0)
            if max(lengths) > 1:  # the longest sample's tokens after its first
                m.request_tpot_s.observe(decode_s / (max(lengths) - 1))
