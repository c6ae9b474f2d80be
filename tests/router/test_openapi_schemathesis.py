"""schemathesis against the served OpenAPI schema (`GET /openapi.json`): a bounded number of
generated requests per operation (valid and invalid bodies) gets no 5xx and no response that
breaks the schema. The server's context is 64 tokens, so generated requests stay cheap: a
large max_tokens is a 400, and omitting it generates at most the rest of the context."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx2
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode, checks
from schemathesis.specs.openapi.checks import response_schema_conformance

from duet.session_store import SqliteSessionStore
from tests.router.rest_server import MODEL_NAME, LiveServer, closing, make_app, make_engine


@pytest.fixture(scope="module")
def fuzzed_server(
    tiny_llama: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    engine = make_engine(tiny_llama, max_model_len=64)
    store = SqliteSessionStore(tmp_path_factory.mktemp("fuzz") / "sessions.db")
    live = LiveServer(make_app(engine, MODEL_NAME, session_store=store, lifespan=closing(store)))
    yield live.start()
    live.stop()
    engine.shutdown()


def test_schema_is_served_and_documents_400_not_422(fuzzed_server: LiveServer) -> None:
    schema = httpx2.get(f"{fuzzed_server.url}/openapi.json", timeout=10).json()
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "404", "409", "429", "503"} <= set(chat) and "422" not in chat
    assert set(schema["paths"]["/v1/sessions/{session_id}"]) == {"get", "delete"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]


OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("POST", "/v1/sessions"),
    ("GET", "/v1/sessions"),
    ("GET", "/v1/sessions/{session_id}"),
    ("DELETE", "/v1/sessions/{session_id}"),
]


@contextmanager
def subnormal_floats() -> Iterator[None]:
    """NOTE: the engine flushes denormals to zero (engine/cpu_runtime.py), a per-thread CPU mode
    this thread has since the first engine started; hypothesis refuses to generate floats under
    it. Engine threads keep their own mode, so turning it off here changes nothing there."""
    torch.set_flush_denormal(False)
    try:
        yield
    finally:
        torch.set_flush_denormal(True)


# NOTE: strategies from the served schema under `@given`, rather than `schemathesis.pytest
# .from_fixture`, whose lazy loading breaks on this pytest (it reads a private attribute).
@pytest.mark.parametrize(
    ("method", "path", "mode"),
    [(method, path, GenerationMode.POSITIVE) for method, path in OPERATIONS]
    # Negative cases need something to break: the operations with a body.
    + [(method, path, GenerationMode.NEGATIVE) for method, path in OPERATIONS if method == "POST"],
)
def test_generated_requests_get_no_5xx_and_match_the_schema(
    fuzzed_server: LiveServer, method: str, path: str, mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")
    operation = schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def call(case: schemathesis.Case) -> None:
        case.call_and_validate(
            checks=[checks.not_a_server_error, response_schema_conformance], timeout=30
        )

    with subnormal_floats():
        call()
