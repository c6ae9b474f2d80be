"""/metrics as tools read it: every metric vLLM's Grafana dashboard queries is exported under
`--metrics-prefix vllm` with data in it, and the KV-transfer metrics of a disaggregated
server move when transfers happen and count a failure when a decode worker dies mid-transfer,
and the probed link rate (tcp and torch_dist) is a gauge per link with the achieved fraction of
it a histogram, under both prefixes."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from duet.cluster.transfer_log import TransferRecord
from duet.engine import AsyncEngine, SamplingParams
from duet.prefill_worker.worker import PrefillRole, PrefillWorker
from duet.router.metrics import ServingMetrics
from tests.cluster.test_cluster_engine import Cluster, prompts_of
from tests.deploy.test_grafana_dashboard import (
    dashboard_metric_names as duet_dashboard_metric_names,
)
from tests.router.rest_server import MODEL_NAME, NUM_KV_BLOCKS, LiveServer, make_app
from tests.waiting import wait_for_async

DASHBOARD = Path(__file__).parent.parent / "data" / "vllm_grafana_dashboard_queries.json"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, from a Prometheus text exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: dict, name: str, **labels: str) -> float:
    matches = [v for (n, ls), v in found.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} samples"
    return matches[0]


def dashboard_metric_names() -> set[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {m for exprs in panels.values() for e in exprs for m in re.findall(r"vllm:\w+", e)}


def test_every_metric_of_vllms_dashboard_has_data(rest_engine: AsyncEngine) -> None:
    live = LiveServer(make_app(rest_engine, MODEL_NAME, metrics_prefix="vllm")).start()
    try:
        with openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0) as client:
            client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            text = httpx2.get(f"{live.url}/metrics").text
    finally:
        live.stop()
    found = samples(text)
    names = dashboard_metric_names()
    assert len(names) == 21  # what the dashboard's 12 panels query
    for name in sorted(names):
        if name.endswith("_bucket"):
            total = value(found, name, model_name=MODEL_NAME, le="+Inf")
            # one request; its 6 tokens are 5 inter-token gaps
            assert total == (5 if "inter_token" in name else 1), name
        elif name.startswith(("vllm:num_requests_", "vllm:kv_cache_usage")):
            assert value(found, name, model_name=MODEL_NAME) == 0  # idle after the request
        elif name == "vllm:request_success_total":
            assert value(found, name, model_name=MODEL_NAME, finished_reason="length") == 1
        else:
            assert value(found, name, model_name=MODEL_NAME) > 0, name
    assert value(found, "vllm:generation_tokens_total", model_name=MODEL_NAME) == 6
    assert value(found, "vllm:request_generation_tokens_sum", model_name=MODEL_NAME) == 6
    # What gateways read besides the dashboard: the KV usage under vLLM's older name too, and
    # the cache's block size (prefix-aware pickers hash prompts in blocks).
    assert value(found, "vllm:gpu_cache_usage_perc", model_name=MODEL_NAME) == 0
    info = value(found, "vllm:cache_config_info", model_name=MODEL_NAME, block_size="16",
                 num_gpu_blocks=str(NUM_KV_BLOCKS), enable_prefix_caching="True")  # fmt: skip
    assert info == 1
    # The duet: names stay, with the same values.
    assert value(found, "duet:generation_tokens_total", model_name=MODEL_NAME) == 6
    # The engine's steps and their time: the model runner's share, the rest its host work.
    steps = value(found, "duet:engine_steps_total", model_name=MODEL_NAME)
    step_s = value(found, "duet:engine_step_seconds_total", model_name=MODEL_NAME)
    execute_s = value(found, "duet:engine_execute_seconds_total", model_name=MODEL_NAME)
    assert steps >= 6 and step_s > execute_s > 0
    # The prefix cache counts tokens, and says so.
    assert "Prompt tokens looked up" in text.split("# HELP duet:prefix_cache_queries_total")[1]


def test_what_autoscalers_and_endpoint_pickers_read_without_a_key(
    rest_engine: AsyncEngine,
) -> None:
    """`metrics_open` (`--metrics-open`): /metrics answers a scraper without a key (and the
    other routes still need one); vLLM's older TPOT name and its LoRA info gauge are there."""
    app = make_app(rest_engine, MODEL_NAME, api_keys=["k"], metrics_prefix="vllm",
                   metrics_open=True)  # fmt: skip
    live = LiveServer(app).start()
    try:
        with openai.OpenAI(base_url=f"{live.url}/v1", api_key="k", max_retries=0) as client:
            client.completions.create(
                model=MODEL_NAME, prompt="hi", max_tokens=6, n=2, extra_body={"ignore_eos": True}
            )
        scraped = httpx2.get(f"{live.url}/metrics")
        assert httpx2.get(f"{live.url}/v1/models").status_code == 401
    finally:
        live.stop()
    assert scraped.status_code == 200
    found = samples(scraped.text)
    for prefix in ("duet", "vllm"):
        tpot = f"{prefix}:time_per_output_token_seconds"
        # one output per step (both samples' tokens in it): 5 gaps
        assert value(found, f"{tpot}_count", model_name=MODEL_NAME) == 5
        assert value(found, f"{tpot}_sum", model_name=MODEL_NAME) == value(
            found, f"{prefix}:inter_token_latency_seconds_sum", model_name=MODEL_NAME
        )
        per_request = f"{prefix}:request_time_per_output_token_seconds"
        assert value(found, f"{per_request}_count", model_name=MODEL_NAME) == 1
        decode_s = value(found, f"{prefix}:request_decode_time_seconds_sum", model_name=MODEL_NAME)
        assert value(found, f"{per_request}_sum", model_name=MODEL_NAME) == pytest.approx(
            decode_s / 5  # a sample's 6 tokens, the first excluded
        )
        lora = value(
            found, f"{prefix}:lora_requests_info", max_lora="0", running_lora_adapters="",
            waiting_lora_adapters="",
        )  # fmt: skip
        assert abs(lora - time.time()) < 60  # vLLM's value: the time it was set


def test_metrics_need_the_key_unless_opened(rest_engine: AsyncEngine) -> None:
    live = LiveServer(make_app(rest_engine, MODEL_NAME, api_keys=["k"])).start()
    try:
        assert httpx2.get(f"{live.url}/metrics").status_code == 401
        keyed = httpx2.get(f"{live.url}/metrics", headers={"Authorization": "Bearer k"})
        assert keyed.status_code == 200
    finally:
        live.stop()


def test_responses_are_counted_by_route_and_status(rest_engine: AsyncEngine) -> None:
    live = LiveServer(make_app(rest_engine, MODEL_NAME, api_keys=["k"])).start()
    try:
        keyed = {"Authorization": "Bearer k"}
        assert httpx2.get(f"{live.url}/v1/models", headers=keyed).status_code == 200
        assert httpx2.get(f"{live.url}/v1/models").status_code == 401
        assert httpx2.get(f"{live.url}/v1/sessions/abc", headers=keyed).status_code == 404
        assert httpx2.get(f"{live.url}/nowhere", headers=keyed).status_code == 404
        text = httpx2.get(f"{live.url}/metrics", headers=keyed).text
    finally:
        live.stop()
    found = samples(text)
    counts = {
        (dict(ls)["route"], dict(ls)["status"]): v
        for (n, ls), v in found.items()
        if n == "duet:http_responses_total"
    }
    assert counts.pop(("/ready", "2xx")) >= 1  # the test server's start-up polls
    assert counts == {
        ("/v1/models", "2xx"): 1,
        ("/v1/models", "4xx"): 1,
        ("/v1/sessions/{session_id}", "4xx"): 1,
        ("unmatched", "4xx"): 1,
    }


def test_kv_transfer_metrics_move_and_count_a_lost_decode_worker(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    block_bytes = 2 * 2 * 8 * 2 * 16 * 4  # K and V x layers x block x kv heads x head dim x fp32

    async def main() -> tuple[str, str]:
        async with Cluster(tiny_llama, num_decode=2, threshold=0) as c:
            metrics = ServingMetrics(c.engine, MODEL_NAME)
            for prompt in prompts_of([40, 70], seed=5):
                await c.run(prompt, params)
            # A reply can end before its attempt's clean-up records the transfer.
            settled = lambda: c.engine.transfers.num_in_flight == 0  # noqa: E731
            await wait_for_async(settled, 10, "the transfers recorded")
            healthy = metrics.render().decode()

            # A prefill that holds its KV back until its decode worker was killed.
            ship = PrefillRole.ship
            killed = threading.Event()

            def slow_ship(self: PrefillRole, done: object) -> None:
                killed.wait(30)
                ship(self, done)  # type: ignore[arg-type]

            monkeypatch.setattr(PrefillRole, "ship", slow_ship)
            run = asyncio.create_task(c.run(prompts_of([60], seed=6)[0], params))
            await wait_for_async(
                lambda: any(w.load.num_waiting_for_kv for w in c.decode), 10,
                "a decode worker to wait for the KV",
            )  # fmt: skip
            victim = next(w for w in c.decode if w.load.num_waiting_for_kv)
            await c.servers[victim.name].stop(0)
            victim.shutdown()
            killed.set()
            out = await asyncio.wait_for(run, 60)
            assert len(out.token_ids) == 3  # finished on the other decode worker
            await wait_for_async(settled, 10, "the transfers recorded")
            return healthy, metrics.render().decode()

    healthy_text, after_text = asyncio.run(main())
    healthy = samples(healthy_text)
    assert value(healthy, "duet:kv_transfers_total", outcome="done") == 2
    assert value(healthy, "duet:kv_transfers_total", outcome="failed") == 0
    assert value(healthy, "duet:kv_transfer_bytes_total") == (5 + 9) * block_bytes
    assert value(healthy, "duet:kv_transfer_duration_seconds_count") == 2
    assert value(healthy, "duet:kv_transfer_duration_seconds_sum") > 0
    assert value(healthy, "duet:kv_transfer_bandwidth_gbps_count") == 2
    assert value(healthy, "duet:kv_transfers_in_flight") == 0
    assert value(healthy, "duet:cache_config_info", block_size="8", num_gpu_blocks="512") == 1

    after = samples(after_text)
    assert value(after, "duet:kv_transfers_total", outcome="failed") == 1
    failures = [v for (n, _), v in after.items() if n == "duet:kv_transfer_failures_total"]
    assert sum(failures) == 1
    migrations = [v for (n, _), v in after.items() if n == "duet:request_migrations_total"]
    assert sum(migrations) == 1
    assert value(after, "duet:kv_transfers_total", outcome="done") == 3
    assert value(after, "duet:kv_transfers_in_flight") == 0
    # duet's own Grafana dashboard reads only names a disaggregated router exports.
    exported = {
        family.name + suffix
        for family in text_string_to_metric_families(after_text)
        for suffix in ("", "_total", "_bucket", "_sum", "_count")
    }
    assert sorted(duet_dashboard_metric_names() - exported) == []


def test_a_prefill_answer_that_comes_after_the_reply_still_records_its_transfer(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reply's last token can reach the router before the prefill worker's answer (what
    the transfer cost). The finished request leaves its attempt to wait for that answer (up
    to `PREFILL_ANSWER_GRACE_S`), so the transfer is recorded done, not cancelled, and is no
    longer counted in flight. (Once the reply's end cancelled that wait, and the transfer
    could stay in flight forever.)"""
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    prefill = PrefillWorker.prefill
    answered: list[float] = []

    async def late_prefill(self: PrefillWorker, *args: object, **kwargs: object) -> object:
        result = await prefill(self, *args, **kwargs)  # type: ignore[arg-type]
        await asyncio.sleep(0.5)  # the decode worker's 2 tokens go out meanwhile
        answered.append(time.monotonic())
        return result

    monkeypatch.setattr(PrefillWorker, "prefill", late_prefill)

    async def main() -> tuple[float, list[TransferRecord]]:
        async with Cluster(tiny_llama, threshold=0) as c:
            replied, outs = 0.0, []
            async for out in c.engine.generate(prompts_of([40], seed=7)[0], params):
                replied = time.monotonic()
                outs.append(out)
            assert outs[-1].finished and len(outs[-1].token_ids) == 2
            settled = lambda: c.engine.transfers.num_in_flight == 0  # noqa: E731
            await wait_for_async(settled, 10, "the transfer recorded")
            return replied, list(c.engine.transfers.recent)

    replied, records = asyncio.run(main())
    assert len(answered) == 1 and answered[0] > replied  # the answer did come after the reply
    assert [(r.status, r.reason) for r in records] == [("done", "")]
    assert records[0].num_bytes > 0


@pytest.mark.parametrize("kv_backend", ["tcp", "torch_dist"])
def test_the_probed_link_rate_and_the_fraction_of_it_achieved(
    tiny_llama: str, kv_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first transfer to the decode worker starts the prefill worker's probe (its result
    has no rate); the two after it carry the rate: the gauge is the sender's probed value and
    the histogram counts those two, their fractions summed."""
    monkeypatch.setenv("DUET_KV_EMULATE_NCCL", "1")  # torch_dist on CPU as NCCL behaves
    # NOTE: enough tokens that each reply ends after the prefill worker's answer (a reply that
    # ends first records its transfer as cancelled).
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

    async def main() -> tuple[float, list[TransferRecord], str, str]:
        async with Cluster(tiny_llama, threshold=0, kv_backend=kv_backend) as c:
            duet, vllm = (
                ServingMetrics(c.engine, MODEL_NAME),
                ServingMetrics(c.engine, MODEL_NAME, "vllm"),
            )
            settled = lambda: c.engine.transfers.num_in_flight == 0  # noqa: E731
            sender, decode = c.prefill[0].sender, c.decode[0]
            for i, prompt in enumerate(prompts_of([40, 50, 60], seed=7)):
                await c.run(prompt, params)
                await wait_for_async(settled, 10, "the transfer recorded")
                if i == 0:  # its result was out before the probe could start
                    await wait_for_async(
                        lambda: sender.link_gbps(decode.kv_address), 20, "the link probe"
                    )
            link_gbps = sender.link_gbps(decode.kv_address)
            assert link_gbps is not None
            return (
                link_gbps,
                list(c.engine.transfers.recent),
                duet.render().decode(),
                vllm.render().decode(),
            )

    link_gbps, records, duet_text, vllm_text = asyncio.run(main())
    assert [r.status for r in records] == ["done"] * 3
    assert [r.link_gbps for r in records] == [0.0, link_gbps, link_gbps]
    fractions = [r.gbps / link_gbps for r in records[1:]]
    for prefix, text in (("duet", duet_text), ("vllm", vllm_text)):
        found = samples(text)
        link = value(found, f"{prefix}:kv_link_bandwidth_gbps", source="p0", destination="d0")
        assert link == link_gbps > 0
        assert value(found, f"{prefix}:kv_transfer_link_fraction_count") == 2
        assert value(found, f"{prefix}:kv_transfer_link_fraction_sum") == pytest.approx(
            sum(fractions), rel=1e-12
        )
        assert value(found, f"{prefix}:kv_transfer_bandwidth_gbps_count") == 3
