"""GET /v1/models, /health, /ready and /metrics."""

from __future__ import annotations

import asyncio
import re

import httpx2
import openai
import pytest

from duet.engine import AsyncEngine
from duet.router.errors import ModelNotFoundError
from duet.router.front_door import FrontDoor, RouterOptions
from duet.router.grpc_server import DuetServicer
from duet.v1 import serving_pb2
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, make_app

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


def test_several_served_names_are_each_a_model(rest_engine: AsyncEngine) -> None:
    """vLLM's several `--served-model-name`s: each is listed and accepted; responses carry
    the first; another name is a 404 naming them all."""
    live = LiveServer(make_app(rest_engine, ("tiny-main", "gpt-4o-mini"))).start()
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-main", "gpt-4o-mini"]
        assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
        out = client.chat.completions.create(model="gpt-4o-mini", max_tokens=2,
                                             messages=[{"role": "user", "content": "hi"}])  # fmt: skip
        assert out.model == "tiny-main"
        with pytest.raises(openai.NotFoundError, match="'tiny-main', 'gpt-4o-mini'"):
            client.completions.create(model="other", prompt="hi", max_tokens=1)
        client.close()
    finally:
        live.stop()


def test_several_served_names_over_grpc(rest_engine: AsyncEngine) -> None:
    servicer = DuetServicer(FrontDoor.compose(rest_engine, ("tiny-main", "alias"), RouterOptions()))
    listed = asyncio.run(servicer.ListModels(serving_pb2.ListModelsRequest(), None))  # type: ignore[arg-type]
    assert [m.id for m in listed.models] == ["tiny-main", "alias"]
    servicer._check_model("alias")
    with pytest.raises(ModelNotFoundError, match="available: tiny-main, alias"):
        servicer._check_model("other")
