"""The workers' engine counters in a disaggregated router's /metrics (their load reports carry
them): the decode workers' speculative-decoding counters (issue #21: they were missing) and
tokens per engine step (`iteration_tokens_total`), summed over the workers; and the
aggregation of several workers' reports."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from duet.engine import SamplingParams
from duet.engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats
from duet.router.metrics import EngineStatsCollector, ServingMetrics
from duet.router.worker_metrics import sum_spec_decode
from duet.v1 import worker_pb2
from tests.cluster.test_cluster_engine import ENGINE, Cluster
from tests.router.rest_server import MODEL_NAME
from tests.router.test_observability_metrics import samples, value
from tests.waiting import wait_for_async

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": 64}  # fmt: skip


def test_a_disaggregated_router_exports_its_decode_workers_spec_decode_counters(
    tiny_llama: str,
) -> None:
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    async def main() -> tuple[str, EngineStats, EngineStats]:
        engine = {**ENGINE, "speculative_config": SPEC}
        async with Cluster(tiny_llama, threshold=0, engine=engine) as c:
            metrics = ServingMetrics(c.engine, MODEL_NAME, prefix="vllm")
            for prompt in ([5, 6, 7, 8, 9] * 6, [11, 12, 13] * 10):
                out = await c.run(prompt, params)
                assert len(out.outputs[0].token_ids) == 16
            decode, prefill = c.decode[0].engine.stats, c.prefill[0].engine.stats
            assert decode.spec_decode is not None and decode.spec_decode.num_draft_tokens > 0

            def reported() -> bool:  # the next load reports carry the final counters
                reports = c.engine.pool.worker_stats.values()
                steps = sum(sum(r.iteration_token_counts) for r in reports)
                spec = sum_spec_decode(r for r in reports if r.speculating)
                return (
                    steps == decode.num_steps + prefill.num_steps
                    and spec is not None
                    and spec.num_draft_tokens == decode.spec_decode.num_draft_tokens  # type: ignore[union-attr]
                )

            await wait_for_async(reported, 10, "the workers' load reports")
            return metrics.render().decode(), decode, prefill

    text, decode, prefill = asyncio.run(main())
    found = samples(text)
    spec = decode.spec_decode
    assert spec is not None
    for prefix in ("duet", "vllm"):
        assert value(found, f"{prefix}:spec_decode_num_drafts_total") == spec.num_drafts
        assert value(found, f"{prefix}:spec_decode_num_draft_tokens_total") == spec.num_draft_tokens
        assert value(found, f"{prefix}:spec_decode_num_accepted_tokens_total") == (
            spec.num_accepted_tokens
        )
        for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
            name = f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total"
            assert value(found, name, position=str(pos)) == n
        assert value(found, f"{prefix}:spec_decode_acceptance_rate") == spec.acceptance_rate
        # Every prefill and decode step of the two workers, with the tokens they computed.
        assert value(found, f"{prefix}:iteration_tokens_total_count") == (
            decode.num_steps + prefill.num_steps
        )
        assert value(found, f"{prefix}:iteration_tokens_total_sum") == (
            decode.iteration_tokens_sum + prefill.iteration_tokens_sum
        )
    assert spec.num_accepted_tokens > 0  # the repetitive prompts are worth speculating on
    # The two prompts' prefill steps computed 30 tokens each: the (16, 32] bucket.
    assert prefill.iteration_token_counts[ITERATION_TOKEN_BUCKETS.index(32)] == 2


def test_worker_reports_are_summed_position_by_position() -> None:
    a = worker_pb2.WorkerStats(
        speculating=True, spec_num_drafts=4, spec_num_draft_tokens=12,
        spec_num_accepted_tokens=6, spec_num_accepted_tokens_per_pos=[4, 2],
    )  # fmt: skip
    b = worker_pb2.WorkerStats(
        speculating=True, spec_num_drafts=1, spec_num_draft_tokens=3,
        spec_num_accepted_tokens=3, spec_num_accepted_tokens_per_pos=[1, 1, 1],
    )  # fmt: skip
    total = sum_spec_decode([a, b])
    assert total is not None
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (5, 15, 9)
    assert total.num_accepted_tokens_per_pos == [5, 3, 1]
    assert sum_spec_decode([]) is None


def test_an_engine_counts_its_steps_by_tokens() -> None:
    stats = EngineStats()
    for n in (1, 2, 8, 9, 16384, 20000):
        stats.observe_step(n)
    counts = dict(zip([*ITERATION_TOKEN_BUCKETS, "inf"], stats.iteration_token_counts, strict=True))
    assert (counts[1], counts[8], counts[16], counts[16384], counts["inf"]) == (1, 2, 1, 1, 1)
    assert sum(stats.iteration_token_counts) == 6
    assert stats.iteration_tokens_sum == 1 + 2 + 8 + 9 + 16384 + 20000
    # An aggregated engine's /metrics reads them from its stats.
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(SimpleNamespace(stats=stats), "m"))  # type: ignore[arg-type]
    lines = generate_latest(registry).decode().splitlines()
    assert 'duet:iteration_tokens_total_bucket{le="8",model_name="m"} 3.0' in lines
    assert 'duet:iteration_tokens_total_count{model_name="m"} 6.0' in lines
