"""The OpenAI-compatible REST server of aggregated mode (one process, one engine).

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models` (and
`/v1/models/{id}`), the Responses
API (`/v1/responses`, router/serving_responses.py), `POST /tokenize`,
`POST /detokenize`, `GET /version`,
`POST/GET /v1/sessions`, `GET/DELETE /v1/sessions/{id}`, with a work queue the Batch API
(router/batch_routes.py), `GET /health` (liveness: the engine
thread runs), `GET /ready` (readiness: it also accepts new requests), `GET /metrics`
(Prometheus text), `GET /openapi.json`. With API keys configured, every route but the two
probes needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Annotated

from fastapi import Body, FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from duet.router.auth import OPEN_PATHS, APIKeyMiddleware, caller_api_key
from duet.router.background import install_background_routes
from duet.router.batch_routes import install_batch_routes
from duet.router.conversations import install_conversation_routes
from duet.router.dashboard import install_dashboard_routes
from duet.router.embeddings_protocol import EmbeddingRequest, EmbeddingResponse
from duet.router.errors import EngineUnavailableError, install_exception_handlers
from duet.router.front_door import FrontDoor
from duet.router.http_limits import BodyLimitMiddleware
from duet.router.http_metrics import HTTPStatusMiddleware
from duet.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from duet.router.openai_responses import (
    BackgroundChatCompletion,
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from duet.router.openai_tokenize import install_tokenize_routes
from duet.router.openapi import error_responses, install_openapi
from duet.router.queue_worker import QueueWorker
from duet.router.serving_context import ServingContext
from duet.router.serving_responses import install_responses_routes
from duet.router.sessions import SessionManager
from duet.router.sessions_protocol import (
    SessionCreateRequest,
    SessionDeleted,
    SessionList,
    SessionMessage,
    SessionObject,
    SessionWithMessages,
)
from duet.router.sse import SSE_EVENT_SCHEMA
from duet.router.web_ui import install_web_ui, open_paths

METRICS_PATH = "/metrics"
"""Prometheus' text; open to callers without a key with `RouterOptions.metrics_open`."""


def build_app(
    front: FrontDoor,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
) -> FastAPI:
    """The REST app over `front`'s services (router/front_door.py: the caller composes them,
    and owns what `RouterOptions` handed in). `lifespan` runs around the app's own (which,
    with a work queue, runs this replica's queue consumers). Several apps may share one
    process (and engine): each front door has its own metrics registry and admission queue."""
    if front.workers:
        lifespan = _with_workers(lifespan, front.workers)
    # NOTE: no interactive docs: they would be one more route to guard, and clients use the
    # OpenAI SDKs anyway. The schema itself is served (behind the key, like every route).
    app = FastAPI(
        title="duet",
        description="OpenAI-compatible LLM serving with stored sessions",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        lifespan=lifespan,
    )
    app.state.front = front
    app.state.serving = front.ctx
    app.state.queue_worker, app.state.background_worker = [*front.workers, None, None][:2]
    app.state.batches = front.batches
    app.state.background = front.background
    install_exception_handlers(app)
    install_openapi(app, front.ctx.engine)
    web_ui = front.options.web_ui
    open_to_all = OPEN_PATHS | (open_paths() if web_ui else set())
    if front.options.metrics_open:
        open_to_all |= {METRICS_PATH}
    limits = front.options.http_limits
    # Inside the key check: a caller without a key never gets as far as its body.
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=limits.body_bytes(front.ctx.engine.max_model_len),
        body_timeout_s=limits.body_timeout_s,
    )
    app.add_middleware(APIKeyMiddleware, checker=front.checker, open_paths=open_to_all)
    # Outermost (added last), so the key check's 401s are counted too.
    app.add_middleware(HTTPStatusMiddleware, metrics=front.ctx.metrics, routes=app.router.routes)
    if web_ui:
        install_web_ui(app)
    install_dashboard_routes(app, front.ctx)
    install_openai_routes(app, front)
    install_responses_routes(app, front.responses)
    install_conversation_routes(app, front.conversations)
    install_session_routes(app, front.ctx.sessions)
    install_tokenize_routes(app, front.ctx)
    if front.batches is not None:
        install_batch_routes(app, front.batches)
    if front.background is not None:
        install_background_routes(app, front.background)
    install_probe_routes(app, front.ctx)
    return app


# One SSE event (`data: <json chunk>` or `data: [DONE]`), as OpenAPI tools parse streams.
_STREAMED = {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}


def install_openai_routes(app: FastAPI, front: FrontDoor) -> None:
    """`POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/embeddings`,
    `GET /v1/models`, `GET /v1/models/{id}`."""
    ctx = front.ctx

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={
            200: {
                "model": ChatCompletionResponse | BackgroundChatCompletion,
                "content": _STREAMED,
            },
            **error_responses(400, 401, 404, 409, 429, 503),
        },
    )
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await front.chat.create(body, raw)

    @app.post(
        "/v1/completions",
        response_model=None,
        responses={
            200: {"model": CompletionResponse, "content": _STREAMED},
            **error_responses(400, 401, 404, 429, 503),
        },
    )
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await front.completions.create(body, raw)

    @app.post(
        "/v1/embeddings",
        response_model=None,
        responses={200: {"model": EmbeddingResponse}, **error_responses(400, 401, 404, 429, 503)},
    )
    async def create_embedding(body: EmbeddingRequest, raw: Request) -> Response:
        return await front.embeddings.create(body, raw)

    def card(name: str) -> ModelCard:
        return ModelCard(
            id=name,
            created=ctx.created,
            max_model_len=ctx.max_model_len,
            deterministic=ctx.engine.deterministic,
        )

    @app.get("/v1/models", responses=error_responses(401))
    async def list_models() -> ModelList:
        return ModelList(data=[card(name) for name in ctx.model_names])

    # `:path`: served names may hold slashes (an HF id such as org/model).
    @app.get("/v1/models/{model:path}", responses=error_responses(401, 404))
    async def retrieve_model(model: str) -> ModelCard:
        ctx.check_model(model)
        return card(model)


def install_session_routes(app: FastAPI, sessions: SessionManager) -> None:
    """`POST/GET /v1/sessions`, `GET/DELETE /v1/sessions/{id}`."""

    @app.post("/v1/sessions", responses=error_responses(400, 401, 404, 503))
    async def create_session(
        raw: Request, body: Annotated[SessionCreateRequest | None, Body()] = None
    ) -> SessionObject:
        metadata, ttl_s = (body.metadata, body.ttl_s) if body is not None else (None, None)
        session = await sessions.create(caller_api_key(raw), metadata, ttl_s)
        return SessionObject.of(session)

    @app.get("/v1/sessions", responses=error_responses(401, 404, 503))
    async def list_sessions(raw: Request) -> SessionList:
        found = await sessions.list_owned(caller_api_key(raw))
        return SessionList(data=[SessionObject.of(s) for s in found])

    @app.get("/v1/sessions/{session_id}", responses=error_responses(401, 404, 503))
    async def get_session(session_id: str, raw: Request) -> SessionWithMessages:
        session, messages = await sessions.read(session_id, caller_api_key(raw))
        return SessionWithMessages(
            **SessionObject.of(session).model_dump(),
            messages=[SessionMessage.model_validate(m) for m in messages],
        )

    @app.delete("/v1/sessions/{session_id}", responses=error_responses(401, 404, 503))
    async def delete_session(session_id: str, raw: Request) -> SessionDeleted:
        await sessions.delete(session_id, caller_api_key(raw))
        return SessionDeleted(id=session_id)


def install_probe_routes(app: FastAPI, ctx: ServingContext) -> None:
    """`GET /health` (the engine runs), `GET /ready` (it takes requests), `GET /metrics`."""

    @app.get("/health")
    async def health() -> Response:
        if not ctx.engine.is_running:
            return EngineUnavailableError("the engine is not running").to_response()
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if not ctx.engine.is_ready:
            return EngineUnavailableError("not ready to serve (no engine or worker)").to_response()
        return JSONResponse({"status": "ready", "model": ctx.model_name})

    @app.get(METRICS_PATH, response_class=PlainTextResponse)  # Prometheus's text format
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _with_workers(
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None,
    workers: list[QueueWorker],
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """`lifespan` with the queue consumers running inside it (started after the caller's
    setup, stopped before its teardown closes the queue)."""

    @asynccontextmanager
    async def combined(app: FastAPI) -> AsyncIterator[None]:
        async with lifespan(app) if lifespan is not None else nullcontext():
            for worker in workers:
                await worker.start()
            try:
                yield
            finally:
                for worker in workers:
                    await worker.stop()

    return combined
