"""The OpenAI-compatible REST server of aggregated mode (one process, one engine).

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`
(liveness: the engine thread runs), `GET /ready` (readiness: it also accepts new requests),
`GET /metrics` (Prometheus text). With API keys configured, every route but the two probes
needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from engine import AsyncEngine
from router.auth import APIKeyChecker, APIKeyMiddleware
from router.errors import EngineUnavailableError, install_exception_handlers
from router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from router.serving_chat import ChatCompletionHandler
from router.serving_completion import CompletionHandler
from router.serving_context import ServingContext

DEFAULT_MAX_QUEUED_REQUESTS = 256
"""Sequences that may wait behind a full running batch before new requests get 503."""


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_keys: Sequence[str] = (),
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
) -> FastAPI:
    """A FastAPI app serving `engine` as `served_model_name`. The caller owns the engine and
    shuts it down after the server stops. Several apps may share one process (and engine):
    each has its own metrics registry and admission queue."""
    if not served_model_name:
        raise ValueError("served_model_name: must not be empty")
    checker = APIKeyChecker(api_keys)
    ctx = ServingContext(engine, served_model_name, max_queued_requests)
    chat = ChatCompletionHandler(ctx)
    completions = CompletionHandler(ctx)
    # NOTE: no interactive docs: they would be one more route to guard, and clients use the
    # OpenAI SDKs anyway.
    app = FastAPI(title="duet", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = ctx
    install_exception_handlers(app)
    app.add_middleware(APIKeyMiddleware, checker=checker)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completions.create(body, raw)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        card = ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=ctx.max_model_len)
        return ModelList(data=[card])

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return EngineUnavailableError("the engine is not running").to_response()
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if not engine.is_running:
            return EngineUnavailableError("the engine is not running").to_response()
        return JSONResponse({"status": "ready", "model": ctx.model_name})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
