"""REST fixtures: one live server (API key required) on the tiny model for the session, the
official `openai` client pointed at it, raw HTTP for what that client cannot express, and a
real redis-server (AOF on) for the session and rate-limit tests."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import openai
import pytest

from duet.engine import LLM, AsyncEngine
from tests.net import free_port
from tests.router.rest_server import (
    API_KEY,
    MODEL_NAME,
    NUM_KV_BLOCKS,
    TRUSTED_TEMPLATES,
    LiveServer,
    make_app,
    make_engine,
)
from tests.session_store.conftest import RedisServer


@pytest.fixture(scope="session")
def rest_engine(tiny_llama: str) -> Iterator[AsyncEngine]:
    engine = make_engine(tiny_llama)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def rest_server(rest_engine: AsyncEngine) -> Iterator[LiveServer]:
    # as started with --trust-request-chat-template: the tool-calling, reasoning and
    # template-option tests send templates of their own (test_request_chat_template.py: the
    # default refuses them)
    app = make_app(rest_engine, MODEL_NAME, api_keys=[API_KEY], chat_options=TRUSTED_TEMPLATES)
    live = LiveServer(app).start()
    yield live
    live.stop()


@pytest.fixture(scope="session")
def reference_llm(tiny_llama: str) -> LLM:
    """The offline API on the same weights: the oracle for greedy outputs."""
    return LLM(tiny_llama, dtype="float32", load_progress=False, num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture
def client(rest_server: LiveServer) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=f"{rest_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture
def http(rest_server: LiveServer) -> Iterator[httpx2.Client]:
    """Raw HTTP (no key unless a test sends one), for framing, bad JSON and auth checks."""
    with httpx2.Client(base_url=rest_server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the tests that only need Redis up; each test uses its own key
    prefix. Tests that kill Redis start their own."""
    server = RedisServer(tmp_path_factory.mktemp("router-redis"), free_port())
    server.start()
    yield server
    server.stop()
