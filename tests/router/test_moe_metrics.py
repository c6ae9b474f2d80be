"""A mixture of experts' expert load (issue 44 item 5) in /metrics and the dashboard's JSON:
`duet:moe_expert_tokens_total{expert}` and `duet:moe_expert_imbalance`, from one engine over
REST and from a disaggregated cluster's load reports; a dense model exports neither."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace

import httpx2
import openai
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from duet.engine import AsyncEngine, SamplingParams
from duet.engine.stats import EngineStats
from duet.router.metrics import EngineStatsCollector, ServingMetrics
from duet.router.worker_metrics import sum_expert_load
from duet.v1 import worker_pb2
from tests.cluster.test_cluster_engine import Cluster
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, make_app, make_engine
from tests.router.test_observability_metrics import samples, value
from tests.waiting import wait_for_async

NUM_EXPERTS, TOP_K, NUM_SPARSE_LAYERS = 16, 2, 2  # tests/conftest.py's qwen3_moe


@pytest.fixture(scope="module")
def moe_engine(tiny_model_factory) -> Iterator[AsyncEngine]:
    engine = make_engine(tiny_model_factory("qwen3_moe"))
    yield engine
    engine.shutdown()


def expert_series(found: dict, prefix: str = "duet") -> list[float]:
    name = f"{prefix}:moe_expert_tokens_total"
    return [value(found, name, model_name=MODEL_NAME, expert=str(e)) for e in range(NUM_EXPERTS)]


def test_one_engine_exports_tokens_per_expert_and_imbalance(moe_engine: AsyncEngine) -> None:
    live = LiveServer(make_app(moe_engine, MODEL_NAME, api_keys=[API_KEY],
                               metrics_prefix="vllm")).start()  # fmt: skip
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    try:
        with openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0) as client:
            client.completions.create(
                model=MODEL_NAME, prompt="the experts share the load", max_tokens=5,
                temperature=0, extra_body={"ignore_eos": True},
            )  # fmt: skip
        text = httpx2.get(f"{live.url}/metrics", headers=keyed).text
        board = httpx2.get(f"{live.url}/v1/dashboard", headers=keyed).json()
    finally:
        live.stop()
    stats = moe_engine.stats
    assert stats.moe_expert_tokens is not None and stats.moe_layer_expert_tokens is not None
    found = samples(text)
    # every token the engine computed went to TOP_K experts in each sparse layer
    expected = stats.iteration_tokens_sum * TOP_K * NUM_SPARSE_LAYERS
    for prefix in ("duet", "vllm"):
        per_expert = expert_series(found, prefix)
        assert per_expert == stats.moe_expert_tokens
        assert sum(per_expert) == expected > 0
        imbalance = value(found, f"{prefix}:moe_expert_imbalance", model_name=MODEL_NAME)
        assert imbalance == stats.moe_expert_imbalance >= 1.0
    assert board["experts"] == {"tokens": stats.moe_expert_tokens,
                                "imbalance": stats.moe_expert_imbalance}  # fmt: skip


def test_a_disaggregated_router_sums_its_workers_expert_load(tiny_model_factory) -> None:
    model = tiny_model_factory("qwen3_moe")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    async def main() -> tuple[str, EngineStats, EngineStats, dict]:
        async with Cluster(model, threshold=0) as c:
            metrics = ServingMetrics(c.engine, MODEL_NAME)
            for prompt in ([5, 6, 7, 8, 9] * 4, [11, 12, 13] * 5):
                out = await c.run(prompt, params)
                assert len(out.outputs[0].token_ids) == 6
            decode, prefill = c.decode[0].engine.stats, c.prefill[0].engine.stats

            def reported() -> bool:  # the next load reports carry the final counts
                load = sum_expert_load(c.engine.pool.worker_stats.values())
                routed = decode.iteration_tokens_sum + prefill.iteration_tokens_sum
                return load is not None and sum(load[0]) == routed * TOP_K * NUM_SPARSE_LAYERS

            await wait_for_async(reported, 10, "the workers' load reports")
            return metrics.render().decode(), decode, prefill, dict(c.engine.pool.worker_stats)

    text, decode, prefill, reports = asyncio.run(main())
    assert decode.moe_expert_tokens is not None and prefill.moe_expert_tokens is not None
    found = samples(text)
    both = [a + b for a, b in zip(decode.moe_expert_tokens, prefill.moe_expert_tokens,
                                  strict=True)]  # fmt: skip
    assert expert_series(found) == both
    assert sum(both) > 0 and decode.iteration_tokens_sum > 0 and prefill.iteration_tokens_sum > 0
    worst = max(r.moe_expert_imbalance for r in reports.values())
    assert value(found, "duet:moe_expert_imbalance", model_name=MODEL_NAME) == worst >= 1.0


def test_reports_without_expert_load_sum_to_none() -> None:
    dense = worker_pb2.WorkerStats(iteration_tokens_sum=3)
    assert sum_expert_load([dense]) is None
    moe = [worker_pb2.WorkerStats(moe_expert_tokens=[1, 2, 3], moe_expert_imbalance=1.5),
           worker_pb2.WorkerStats(moe_expert_tokens=[4, 0, 0], moe_expert_imbalance=3.0)]  # fmt: skip
    assert sum_expert_load([dense, *moe]) == ([5, 2, 3], 3.0)


def test_a_dense_model_exports_no_expert_series() -> None:
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(SimpleNamespace(stats=EngineStats()), "m"))  # type: ignore[arg-type]
    assert "moe_" not in generate_latest(registry).decode()
