"""The OpenAI-compatible REST server of aggregated mode (one process, one engine).

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `POST /tokenize`,
`POST /detokenize`, `GET /version`,
`POST/GET /v1/sessions`, `GET/DELETE /v1/sessions/{id}`, with a work queue the Batch API
(router/batch_routes.py), `GET /health` (liveness: the engine
thread runs), `GET /ready` (readiness: it also accepts new requests), `GET /metrics`
(Prometheus text), `GET /openapi.json`. With API keys configured, every route but the two
probes needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Annotated

from fastapi import Body, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST

from duet.router.admission import AdmissionController
from duet.router.auth import OPEN_PATHS, APIKeyChecker, APIKeyMiddleware, caller_api_key
from duet.router.background import KIND as BACKGROUND_KIND
from duet.router.background import BackgroundService, install_background_routes
from duet.router.batch_routes import install_batch_routes
from duet.router.batch_runner import BatchPriority, BatchRunner
from duet.router.batches import BatchService
from duet.router.dashboard import install_dashboard_routes
from duet.router.engine_client import EngineClient
from duet.router.errors import EngineUnavailableError, install_exception_handlers
from duet.router.http_metrics import HTTPStatusMiddleware
from duet.router.openai_chat import ChatOptions
from duet.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from duet.router.openai_responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from duet.router.openai_tokenize import install_tokenize_routes
from duet.router.openapi import error_responses, install_openapi
from duet.router.queue_worker import QueueWorker
from duet.router.rate_limit import NO_RATE_LIMITS, RequestRateLimiter
from duet.router.serving_chat import ChatCompletionHandler
from duet.router.serving_completion import CompletionHandler
from duet.router.serving_context import ServingContext
from duet.router.sessions import SessionManager
from duet.router.sessions_protocol import (
    SessionCreateRequest,
    SessionDeleted,
    SessionList,
    SessionMessage,
    SessionObject,
    SessionWithMessages,
)
from duet.router.tracing import RequestTracing
from duet.router.web_ui import install_web_ui, open_paths
from duet.session_store import RateLimiter, RateLimits, SessionStore, WorkQueue


def build_app(
    engine: EngineClient,
    served_model_name: str,
    api_keys: Sequence[str] = (),
    max_queued_requests: int | None = None,
    session_store: SessionStore | None = None,
    rate_limiter: RateLimiter | None = None,
    rate_limits: RateLimits = NO_RATE_LIMITS,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
    admission: AdmissionController | None = None,
    work_queue: WorkQueue | None = None,
    batch_priority: BatchPriority | None = None,
    chat_options: ChatOptions | None = None,
    web_ui: bool = True,
    metrics_prefix: str = "duet",
    tracer_provider: TracerProvider | None = None,
) -> FastAPI:
    """A FastAPI app serving `engine` as `served_model_name`. The caller owns the engine, the
    session store and the rate limiter, and closes them after the server stops (`lifespan`
    may do it). Without a session store, session routes and `session_id` answer 404; rate
    limits need a rate limiter. Several apps may share one process (and engine): each has its
    own metrics registry and admission queue, unless `admission` is shared (REST and gRPC in
    one server share one). `max_queued_requests`: a fixed queue bound, or None for the default
    time-bounded queue (router/admission.py); ignored when `admission` is given. With a
    `work_queue` (which the caller also owns), the Batch API is served and the app's lifespan
    runs this replica's queue consumer (router/queue_worker.py) at `batch_priority`.
    `chat_options`: the tool-call and reasoning parsers (router/openai_chat.py). `web_ui`:
    serve the chat page at `/` and the cluster dashboard (router/web_ui.py). `metrics_prefix`:
    `duet`, or `vllm` to add vLLM's metric names (router/metrics.py). `tracer_provider`: where
    each request's trace goes (router/tracing.py); None: no tracing."""
    if not served_model_name:
        raise ValueError("served_model_name: must not be empty")
    checker = APIKeyChecker(api_keys)
    sessions = SessionManager(session_store)
    if admission is None:
        admission = AdmissionController(lambda: engine.max_num_seqs, max_queued_requests)
    ctx = ServingContext(
        engine,
        served_model_name,
        admission,
        sessions,
        RequestRateLimiter(rate_limiter, rate_limits),
        chat_options,
        metrics_prefix,
        RequestTracing(tracer_provider.get_tracer("duet.router") if tracer_provider else None),
    )
    chat = ChatCompletionHandler(ctx)
    completions = CompletionHandler(ctx)
    worker: QueueWorker | None = None
    background_worker: QueueWorker | None = None
    batches: BatchService | None = None
    if work_queue is not None:
        batches = BatchService(work_queue, served_model_name)
        adm = admission
        priority = batch_priority or BatchPriority()
        background = BackgroundService(work_queue.queue_named("background"), ctx)
        chat.background = background
        worker = QueueWorker(
            work_queue,
            BatchRunner(ctx, batches).runners,
            lambda num_running: priority.free_slots(adm, num_running),
        )
        # Background requests are interactive work that outlives its connection: their own
        # queue (never behind a batch), taken whenever admission has room.
        background_worker = QueueWorker(
            background.queue,
            {BACKGROUND_KIND: background.run},
            lambda num_running: max(0, adm.max_running - num_running) if adm.can_admit(1) else 0,
        )
        lifespan = _with_workers(lifespan, [worker, background_worker])
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
    app.state.serving = ctx
    app.state.queue_worker = worker
    app.state.background_worker = background_worker
    app.state.batches = batches
    app.state.background = chat.background
    install_exception_handlers(app)
    install_openapi(app)
    app.add_middleware(
        APIKeyMiddleware,
        checker=checker,
        open_paths=OPEN_PATHS | (open_paths() if web_ui else set()),
    )
    # Outermost (added last), so the key check's 401s are counted too.
    app.add_middleware(HTTPStatusMiddleware, metrics=ctx.metrics, routes=app.router.routes)
    if web_ui:
        install_web_ui(app)
    install_dashboard_routes(app, ctx)

    # One SSE event (`data: <json chunk>` or `data: [DONE]`), as OpenAPI tools parse streams.
    sse_event = {
        "type": "object",
        "properties": {
            "data": {"type": "string"},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
        "required": ["data"],
    }
    streamed = {"text/event-stream": {"schema": sse_event}}

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={
            200: {"model": ChatCompletionResponse, "content": streamed},
            **error_responses(400, 401, 404, 409, 429, 503),
        },
    )
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw)

    @app.post(
        "/v1/completions",
        response_model=None,
        responses={
            200: {"model": CompletionResponse, "content": streamed},
            **error_responses(400, 401, 404, 429, 503),
        },
    )
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completions.create(body, raw)

    @app.get("/v1/models", responses=error_responses(401))
    async def list_models() -> ModelList:
        card = ModelCard(
            id=ctx.model_name,
            created=ctx.created,
            max_model_len=ctx.max_model_len,
            deterministic=ctx.engine.deterministic,
        )
        return ModelList(data=[card])

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

    install_tokenize_routes(app, ctx)
    if batches is not None:
        install_batch_routes(app, batches)
    if chat.background is not None:
        install_background_routes(app, chat.background)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return EngineUnavailableError("the engine is not running").to_response()
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if not engine.is_ready:
            return EngineUnavailableError("not ready to serve (no engine or worker)").to_response()
        return JSONResponse({"status": "ready", "model": ctx.model_name})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


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
