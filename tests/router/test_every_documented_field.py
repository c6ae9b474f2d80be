"""Every request field the official `openai` SDK documents for chat completions and responses
(read from its own TypedDicts, so a field a new SDK adds fails here until it is classified), sent
at once with a value that asks for something: the answer is a 200, and each field is either
honoured (the test that checks it named beside it) or named in the `duet-ignored-fields`
header."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import completion_create_params
from openai.types.responses import response_create_params

from duet.engine import AsyncEngine
from duet.session_store import SqliteSessionStore
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, closing, make_app

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
HEADER = "duet-ignored-fields"

# Chat completions: field -> (a value asking for something, where it is checked). `stream` is
# the SDK's argument rather than a TypedDict key of the base.
CHAT_HONOURED: dict[str, tuple[Any, str]] = {
    "messages": ([{"role": "user", "content": "hi"}], "test_chat_completions.py"),
    "model": (MODEL_NAME, "test_errors.py (an unknown model is a 404)"),
    "frequency_penalty": (0.5, "tests/engine/test_sampling.py"),
    "presence_penalty": (0.5, "tests/engine/test_sampling.py"),
    "logit_bias": ({"5": 1.0}, "test_sampling_fields.py"),
    "logprobs": (True, "test_chat_completions.py"),
    "top_logprobs": (2, "test_chat_completions.py"),
    "max_completion_tokens": (3, "test_chat_completions.py"),
    "max_tokens": (3, "test_chat_completions.py"),
    "n": (2, "test_chat_completions.py"),
    "parallel_tool_calls": (False, "test_tool_calling.py"),
    "response_format": ({"type": "json_object"}, "test_structured_outputs.py"),
    "seed": (7, "tests/engine/test_sampling.py"),
    "stop": (["\n\n\n"], "test_chat_completions.py"),
    "stream_options": ({"include_usage": True}, "test_streaming.py"),
    "temperature": (0.5, "tests/engine/test_sampling.py"),
    "top_p": (0.9, "tests/engine/test_sampling.py"),
    "tool_choice": ("none", "test_tool_calling.py"),
    "tools": ([TOOL], "test_tool_calling.py"),
    "user": ("u1", "an identifier for the caller's records: nothing to do"),
    "safety_identifier": ("u1", "as user"),
    "prompt_cache_key": ("k1", "a cache hint: duet caches prefixes on its own"),
}
CHAT_IGNORED: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"},
    "function_call": {"name": "f"},
    "functions": [TOOL["function"]],
    "metadata": {"k": "v"},
    "modalities": ["text", "audio"],
    "moderation": {"model": "omni-moderation-latest"},
    "prediction": {"type": "content", "content": "x"},
    "prompt_cache_options": {"ttl": "30m"},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "high",  # the tiny model's template does not read it
    "service_tier": "flex",
    "store": True,
    "verbosity": "low",
    "web_search_options": {"search_context_size": "low"},
}

# Responses: the same split.
RESPONSES_HONOURED: dict[str, tuple[Any, str]] = {
    "model": (MODEL_NAME, "test_responses.py"),
    "input": ("Tell me a story", "test_responses.py"),
    "instructions": ("Be brief.", "test_responses.py"),
    "max_output_tokens": (4, "test_responses.py"),
    "temperature": (0.5, "as chat's"),
    "top_p": (0.9, "as chat's"),
    "tools": (
        [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "test_responses.py",
    ),
    "tool_choice": ("none", "test_responses.py"),
    "parallel_tool_calls": (False, "as chat's"),
    "text": ({"format": {"type": "json_object"}}, "test_responses.py (json_schema)"),
    "store": (True, "test_responses.py"),
    "metadata": ({"k": "v"}, "stored and echoed: checked below"),
    "previous_response_id": (None, "set below to a stored response: test_responses.py"),
    "background": (False, "test_responses.py (needs a work queue)"),
    "max_tool_calls": (2, "built-in tools only; duet has none"),
    "reasoning": ({"effort": "low"}, "the template variable; named when not read"),
    "user": ("u1", "stored and echoed"),
    "safety_identifier": ("u1", "stored and echoed"),
    "prompt_cache_key": ("k1", "a cache hint"),
    "truncation": ("auto", "test_responses.py"),
    "include": (["message.output_text.logprobs"], "test_responses.py"),
    "top_logprobs": (2, "test_responses.py"),
    "conversation": (None, "test_conversations.py (not with previous_response_id, set here)"),
}
RESPONSES_IGNORED: dict[str, Any] = {
    "access_programs": {"cyber": "standard"},
    "background_options": {"x": 1},
    "context_management": [{"type": "compaction", "compact_threshold": 1000}],
    "image": {"context_compression": "auto"},
    "moderation": {"model": "omni-moderation-latest"},
    "prompt": {"id": "pmpt_123"},
    "prompt_cache_options": {"ttl": "30m"},
    "prompt_cache_retention": "24h",
    "service_tier": "flex",
    "stream_options": {"include_obfuscation": False},
}


@pytest.fixture(scope="module")
def client(rest_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    db: Path = tmp_path_factory.mktemp("every-field") / "duet.db"
    store = SqliteSessionStore(db)
    app = make_app(rest_engine, MODEL_NAME, api_keys=[API_KEY], session_store=store,
                   lifespan=closing(store))  # fmt: skip
    live = LiveServer(app).start()
    c = openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    yield c
    c.close()
    live.stop()


def test_the_tables_cover_every_field_the_sdk_documents() -> None:
    chat = set(completion_create_params.CompletionCreateParamsBase.__annotations__)
    assert chat == set(CHAT_HONOURED) | set(CHAT_IGNORED)
    assert not set(CHAT_HONOURED) & set(CHAT_IGNORED)
    responses = set(response_create_params.ResponseCreateParamsBase.__annotations__)
    assert responses == set(RESPONSES_HONOURED) | set(RESPONSES_IGNORED)
    assert not set(RESPONSES_HONOURED) & set(RESPONSES_IGNORED)


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_completion_with_every_field(client: openai.OpenAI, stream: bool) -> None:
    fields = {name: value for name, (value, _) in CHAT_HONOURED.items()} | CHAT_IGNORED
    if not stream:
        del fields["stream_options"]  # OpenAI takes it with stream only
    raw = client.chat.completions.with_raw_response.create(stream=stream, **fields)
    assert raw.http_response.status_code == 200
    assert sorted(raw.headers[HEADER].split(",")) == sorted(CHAT_IGNORED)
    if not stream:
        out = raw.parse()
        assert len(out.choices) == 2  # n
        assert all(c.logprobs is not None for c in out.choices)  # logprobs
        assert out.usage is not None and out.usage.completion_tokens <= 6  # max_tokens 3, n 2
    else:
        chunks = list(raw.parse())
        assert chunks[-1].usage is not None  # stream_options.include_usage
        assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_a_response_with_every_field(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL_NAME, input="hello", max_output_tokens=2)
    fields = {name: value for name, (value, _) in RESPONSES_HONOURED.items()} | RESPONSES_IGNORED
    fields["previous_response_id"] = first.id
    raw = client.responses.with_raw_response.create(**fields)
    assert raw.http_response.status_code == 200
    named = raw.headers[HEADER].split(",")
    # reasoning.effort: the tiny model's template does not read it, so it is named too
    assert sorted(named) == sorted([*RESPONSES_IGNORED, "reasoning.effort"])
    out = raw.parse()
    assert out.previous_response_id == first.id
    assert out.metadata == {"k": "v"}
    assert (out.user, out.safety_identifier, out.max_tool_calls) == ("u1", "u1", 2)
    assert out.prompt_cache_key == "k1"
    assert out.usage is not None and out.usage.output_tokens <= 4
    logprobs = out.output[0].content[0].logprobs
    assert len(logprobs) == out.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)
