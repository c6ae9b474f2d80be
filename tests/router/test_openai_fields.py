"""No OpenAI field silently ignored: one duet does not implement is accepted, and named in the
`duet-ignored-fields` header (and a warning) unless its value asks for nothing;
`reasoning_effort` reaches chat templates that read it; a field that is not OpenAI's is ignored
with a warning naming it."""

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
        ("reasoning_effort", "high"),  # the tiny model's template does not read it
        ("verbosity", "low"),
        ("web_search_options", {}),
        ("service_tier", "flex"),
        ("store", True),
        ("metadata", {"k": "v"}),
    ],
)
def test_unimplemented_openai_fields_are_named_in_the_ignored_fields_header(
    http: httpx2.Client, field: str, value: object, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="duet.router.openai_fields"):
        r = _chat(http, **{field: value})
    assert r.status_code == 200, r.text
    assert r.headers["duet-ignored-fields"] == field
    if field != "reasoning_effort":
        assert f"ignoring fields duet does not implement: ['{field}']" in caplog.text


def test_reasoning_effort_reaches_a_template_that_reads_it(client: openai.OpenAI) -> None:
    template = (
        "{{ reasoning_effort or 'none' }}: {% for m in messages %}{{ m.content }}{% endfor %}"
    )
    lengths = {}
    for effort in ("low", "xhigh"):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=1, reasoning_effort=effort,
            extra_body={"chat_template": template},
        )  # fmt: skip
        assert "duet-ignored-fields" not in raw.headers
        usage = raw.parse().usage
        assert usage is not None
        lengths[effort] = usage.prompt_tokens
    assert lengths["low"] != lengths["xhigh"]  # the effort is in the prompt


def test_values_that_ask_for_nothing_are_accepted(http: httpx2.Client) -> None:
    r = _chat(
        http, tools=[], tool_choice="none", parallel_tool_calls=True, functions=None,
        modalities=["text"], service_tier="auto", store=False, metadata={},
        prompt_cache_key="k1", safety_identifier="u1", user="u",
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_the_openai_client_sends_metadata_and_sees_the_header(client: openai.OpenAI) -> None:
    """What openai-agents' `ModelSettings(metadata=...)` sends: accepted, named, streamed too."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=2, metadata={"run": "1"}, store=True,
        stream=True,
    )  # fmt: skip
    assert raw.headers["duet-ignored-fields"] == "store,metadata"
    chunks = list(raw.parse())
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


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
