"""GET /v1/models, /health, /ready and /metrics."""

from __future__ import annotations

import re

import httpx2
import openai

from duet.engine import AsyncEngine
from tests.router.rest_server import API_KEY, MODEL_NAME, make_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}
METRIC_NAMES = [
    "duet:time_to_first_token_seconds",
    "duet:inter_token_latency_seconds",
    "duet:e2e_request_latency_seconds",
    "duet:prompt_tokens_total",
    "duet:generation_tokens_total",
    "duet:num_requests_running",
    "duet:num_requests_waiting",
    "duet:kv_cache_usage_perc",
    "duet:prefix_cache_hit_rate",
]


def test_models(client: openai.OpenAI, rest_engine: AsyncEngine) -> None:
    [card] = client.models.list().data
    assert card.id == MODEL_NAME
    assert card.object == "model"
    assert card.owned_by == "duet"
    # The CPU kernels and the probed linears: deterministic (docs/determinism.md).
    assert rest_engine.deterministic
    assert card.model_extra == {"max_model_len": 1024, "deterministic": True}


def test_probes(http: httpx2.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").json() == {"status": "ready", "model": MODEL_NAME}


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_metrics_after_a_request(client: openai.OpenAI, http: httpx2.Client) -> None:
    before = http.get("/metrics", headers=AUTH).text
    resp = client.completions.create(
        model=MODEL_NAME, prompt="metrics please", max_tokens=5, extra_body={"ignore_eos": True}
    )
    r = http.get("/metrics", headers=AUTH)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in METRIC_NAMES:
        assert re.search(rf"^{re.escape(name)}", text, re.MULTILINE), name
    usage = resp.usage
    assert usage is not None
    delta = lambda name: _sample(text, name) - _sample(before, name)  # noqa: E731
    assert delta("duet:prompt_tokens_total") == usage.prompt_tokens
    assert delta("duet:generation_tokens_total") == 5
    assert delta("duet:time_to_first_token_seconds_count") == 1
    assert delta("duet:e2e_request_latency_seconds_count") == 1
    assert delta("duet:inter_token_latency_seconds_count") == 4
    assert _sample(text, "duet:num_requests_running") == 0
    assert 0 <= _sample(text, "duet:kv_cache_usage_perc") <= 1
    assert 'model_name="tiny-llama"' in text


def test_apps_sharing_a_process_have_their_own_registries(rest_engine: AsyncEngine) -> None:
    first = make_app(rest_engine, "a")
    second = make_app(rest_engine, "b")  # a shared global registry would raise here
    assert first.state.serving.metrics.registry is not second.state.serving.metrics.registry
    assert b'model_name="b"' in second.state.serving.metrics.render()
