"""Helpers for the REST tests: a live uvicorn server in a background thread, engines on the
tiny model, a lifespan that closes session stores in the server's loop, and a bounded wait for
the engine to be idle with every KV block free."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

import httpx2
import uvicorn
from fastapi import FastAPI

from duet.engine import AsyncEngine, EngineConfig
from duet.router.api_server import build_app
from duet.router.engine_client import EngineClient
from duet.router.front_door import FrontDoor, RouterOptions
from duet.router.openai_chat import ChatOptions
from tests.waiting import wait_for

MODEL_NAME = "tiny-llama"
API_KEY = "sk-test-key"
NUM_KV_BLOCKS = 2048  # 32k tokens: plenty for the tests, far less memory than the default pool


TRUSTED_TEMPLATES = ChatOptions(trust_request_chat_template=True)
"""A server started with `--trust-request-chat-template`, for tests that send templates."""


def make_app(
    engine: EngineClient,
    model_name: str = MODEL_NAME,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
    **options: Any,
) -> FastAPI:
    """`build_app` over a front door composed from `RouterOptions(**options)`."""
    return build_app(FrontDoor.compose(engine, model_name, RouterOptions(**options)), lifespan)


class LiveServer:
    """Runs `app` with uvicorn on 127.0.0.1 (a free port) in a daemon thread until `stop()`."""

    def __init__(self, app: FastAPI, http: type[asyncio.Protocol] | str = "auto") -> None:
        """`http`: uvicorn's HTTP protocol (`duet serve` passes router/http_limits.py's)."""
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2, http=http
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self, timeout_s: float = 30.0) -> LiveServer:
        self._thread.start()
        try:
            wait_for(self._ready, timeout_s, f"the server on {self.url} to be ready", 0.05)
        except AssertionError:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        try:
            return httpx2.get(f"{self.url}/ready", timeout=1.0).status_code == 200
        except httpx2.TransportError:
            return False

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()


class Closable(Protocol):
    async def close(self) -> None: ...


def closing(*closables: Closable) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """A lifespan that closes session stores and rate limiters when the server stops, in the
    server's own event loop (the one their connections belong to), and keeps that loop in
    `app.state.loop`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Tests run coroutines in the server's loop through it (run_coroutine_threadsafe).
        app.state.loop = asyncio.get_running_loop()
        try:
            yield
        finally:
            for closable in closables:
                await closable.close()

    return lifespan


def make_engine(
    model: str, max_num_seqs: int = 128, max_model_len: int | None = None
) -> AsyncEngine:
    config = EngineConfig(
        model=model,
        dtype="float32",
        load_progress=False,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )
    return AsyncEngine.from_config(config)


def wait_until_idle(engine: AsyncEngine, timeout_s: float = 10.0) -> bool:
    """True once the engine has no requests and every KV block is free; AssertionError if that
    takes over `timeout_s`."""
    inner = engine.engine
    return wait_for(
        lambda: (
            not inner.has_unfinished_requests() and inner.kv.num_free_blocks == inner.num_blocks
        ),
        timeout_s,
        "the engine to finish every request and free every KV block",
        0.02,
    )
