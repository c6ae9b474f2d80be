"""No OpenAI field silently ignored: one duet does not implement is a 400 naming it unless its
value asks for nothing; a field that is not OpenAI's is ignored with a warning naming it."""

from __future__ import annotations

import logging

import httpx2
import openai
import pytest

from tests.router.rest_server import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _chat(http: httpx2.Client, **extra) -> httpx2.Response:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, **extra}
    return http.post("/v1/chat/completions", json=body, headers=AUTH)


@pytest.mark.parametrize(
    "field, value",
    [
        ("functions", [TOOL["function"]]),
        ("function_call", {"name": "f"}),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("reasoning_effort", "high"),
        ("verbosity", "low"),
        ("web_search_options", {}),
        ("service_tier", "flex"),
        ("store", True),
        ("metadata", {"k": "v"}),
    ],
)
def test_unimplemented_openai_fields_are_400_naming_them(
    http: httpx2.Client, field: str, value: object
) -> None:
    r = _chat(http, **{field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["type"]) == (field, "invalid_request_error")
    assert error["message"].startswith(f"{field}: is not supported by this server")


def test_values_that_ask_for_nothing_are_accepted(http: httpx2.Client) -> None:
    r = _chat(
        http, tools=[], tool_choice="none", parallel_tool_calls=True, functions=None,
        modalities=["text"], service_tier="auto", store=False, metadata={},
        prompt_cache_key="k1", safety_identifier="u1", user="u",
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_the_openai_client_sees_the_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=2,
            prediction={"type": "content", "content": "x"},
        )
    assert e.value.status_code == 400
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "prediction"


def test_fields_that_are_not_openais_are_ignored_with_a_warning(
    http: httpx2.Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="duet.router.openai_fields"):
        r = _chat(http, a_field_from_the_future=1)
        completion = http.post(
            "/v1/completions",
            json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "not_a_field": 2},
            headers=AUTH,
        )
    assert (r.status_code, completion.status_code) == (200, 200)
    warnings = [
        rec.getMessage() for rec in caplog.records if rec.name == "duet.router.openai_fields"
    ]
    assert any("ChatCompletionRequest" in m and "a_field_from_the_future" in m for m in warnings)
    assert any("CompletionRequest" in m and "not_a_field" in m for m in warnings)
