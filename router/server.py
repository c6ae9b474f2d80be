"""One router process: REST (uvicorn) and gRPC (grpc.aio) on one event loop, sharing the
engine, the session store and the rate limiter. `duet serve` runs it.

Lifecycle:
- Start: uvicorn owns the event loop; the app's lifespan starts the gRPC server in it, then the
  log says where each endpoint listens.
- Stop (Ctrl-C, SIGTERM): both servers stop taking new work at once. In-flight requests get
  `shutdown_timeout_s` to finish; after that the engine is stopped, which ends every remaining
  request with a retryable error (an SSE error event and no `[DONE]` on REST, UNAVAILABLE on
  gRPC), never a silent cut or a hang. Then the session store and rate limiter close.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import uvicorn
from fastapi import FastAPI

from duet.engine.sampling_params import POOLING_TYPES
from duet.router.admission import DEFAULT_MAX_QUEUE_WAIT_S
from duet.router.api_server import build_app
from duet.router.engine_client import EngineClient
from duet.router.front_door import FrontDoor, RouterOptions
from duet.router.grpc_server import SERVICE_NAME, start_grpc_server
from duet.router.http_limits import HttpLimits, bounded_h11_protocol
from duet.router.metrics import METRICS_PREFIXES
from duet.router.openai_chat import ChatOptions
from duet.router.rate_limit import NO_RATE_LIMITS
from duet.router.tracing import otlp_tracer_provider
from duet.session_store import (
    DEFAULT_EVENT_TTL_S,
    DEFAULT_LEASE_S,
    DEFAULT_MAX_DELIVERIES,
    DEFAULT_RETENTION_S,
    RateLimits,
    SqliteSessionStore,
    SqliteWorkQueue,
    check_store_url,
    open_rate_limiter,
    open_session_store,
    open_work_queue,
)

logger = logging.getLogger("duet.serve")

_BACKSTOP_S = 5.0
"""Extra time uvicorn and gRPC wait after the drain, in case the engine is slow to stop."""


@dataclass(frozen=True)
class RouterConfig:
    """How `duet serve` exposes one engine."""

    host: str = "127.0.0.1"
    """Address both servers bind."""
    port: int = 8000
    """REST port; 0 picks a free one."""
    grpc_port: int = 50051
    """gRPC port; 0 picks a free one."""
    api_keys: tuple[str, ...] = ()
    """Accepted keys; none: no authentication (every caller is "anonymous")."""
    max_queued_requests: int | None = None
    """Sequences that may wait behind a full batch before new requests get 503; None: as many
    as can start within `max_queue_wait_s` at the measured drain rate (router/admission.py)."""
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S
    """With the default queue bound: the longest estimated wait a new request may face."""
    session_store_url: str | None = None
    """`redis://...` or `sqlite:///...`; None: the embedded SQLite file in the user data dir."""
    rate_limits: RateLimits = NO_RATE_LIMITS
    """Per-key requests/min and tokens/min (unlimited by default)."""
    shutdown_timeout_s: float = 10.0
    """On stop, how long in-flight requests may run before they are ended with an error."""

    # --- the durable work queue (docs/queue.md) ---
    queue_url: str | None = None
    """Where the work queue (Batch API) lives; None: the session store's backend."""
    queue_lease_s: float = DEFAULT_LEASE_S
    """How long a router may hold a task without renewing before another takes it over."""
    queue_max_deliveries: int = DEFAULT_MAX_DELIVERIES
    """Deliveries without a result before a task is dead-lettered."""
    queue_event_ttl_s: float = DEFAULT_EVENT_TTL_S
    """How long a background request's event log (its stream) lives after its last event."""
    queue_retention_s: float = DEFAULT_RETENTION_S
    """How long results, dead letters, batches and files without an expiry of their own are
    kept after their last write."""

    # --- chat replies (docs/tool_calling.md) ---
    embedding_pooling: str = "auto"
    """How `/v1/embeddings` pools a prompt's final hidden states: last, mean, cls, or auto (the
    model's sentence-transformers configuration, else last)."""
    tool_call_parser: str | None = None
    """hermes, llama3_json or mistral; None: inferred from the chat template."""
    reasoning_parser: str | None = None
    """qwen3 or deepseek_r1: thinking goes to `reasoning_content`; None: it stays in content."""
    trust_request_chat_template: bool = False
    """Render chat templates that requests bring (`ChatOptions`); off: a 400."""

    @property
    def chat_options(self) -> ChatOptions:
        return ChatOptions(
            self.tool_call_parser, self.reasoning_parser, self.trust_request_chat_template
        )

    # --- pages and observability (docs/web_ui.md, docs/observability.md) ---
    web_ui: bool = True
    """Serve the chat page at `/` and the cluster dashboard at `/dashboard`."""
    metrics_prefix: str = "duet"
    """`duet`: metrics under `duet:` names; `vllm`: also under vLLM's `vllm:` names."""
    metrics_open: bool = False
    """`GET /metrics` without an API key (for scrapers that send none)."""
    otlp_endpoint: str | None = None
    """Export each request's trace over OTLP/gRPC to this collector; None: no tracing."""

    # --- what one REST client may cost (router/http_limits.py) ---
    max_body_bytes: int | None = None
    """Largest request body (413 beyond); None: sized from the model's context."""
    header_timeout_s: float = HttpLimits.header_timeout_s
    """A request's headers must arrive within this long, else the connection is closed."""
    body_timeout_s: float = HttpLimits.body_timeout_s
    """A request's body must arrive within this long of its headers, else 408."""
    max_connections: int = HttpLimits.max_connections
    """Open REST connections at most; one more gets a 503 and is closed."""

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            self.max_body_bytes, self.header_timeout_s, self.body_timeout_s, self.max_connections
        )

    def __post_init__(self) -> None:
        for flag, port in (("--port", self.port), ("--grpc-port", self.grpc_port)):
            if not 0 <= port <= 65535:
                raise ValueError(f"{flag}: must be in [0, 65535]; got {port}")
        if self.port == self.grpc_port != 0:  # else the second server fails after the model loads
            raise ValueError(f"--grpc-port: must differ from --port (both {self.port})")
        if not self.max_queue_wait_s > 0:
            raise ValueError(f"--max-queue-wait: must be > 0; got {self.max_queue_wait_s}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests: must be >= 0; got {self.max_queued_requests}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout: must be >= 0; got {self.shutdown_timeout_s}")
        if self.metrics_prefix not in METRICS_PREFIXES:
            raise ValueError(
                f"--metrics-prefix: must be one of {', '.join(METRICS_PREFIXES)}; "
                f"got {self.metrics_prefix!r}"
            )
        if self.embedding_pooling not in ("auto", *POOLING_TYPES):
            raise ValueError(
                f"--embedding-pooling: must be one of auto, {', '.join(POOLING_TYPES)}; "
                f"got {self.embedding_pooling!r}"
            )
        self._check_queue()
        self.http_limits  # noqa: B018  # validates them, naming the flag
        try:
            self.chat_options  # noqa: B018  # validates the parser names
        except ValueError as e:
            field, _, message = str(e).partition(": ")
            raise ValueError(f"--{field.replace('_', '-')}: {message}") from None

    def _check_queue(self) -> None:
        if self.queue_url is not None:
            check_store_url(self.queue_url, "--queue-url")
        if not self.queue_lease_s > 0:
            raise ValueError(f"--queue-lease: must be > 0; got {self.queue_lease_s}")
        if self.queue_max_deliveries < 1:
            raise ValueError(
                f"--queue-max-deliveries: must be >= 1; got {self.queue_max_deliveries}"
            )
        if not (math.isfinite(self.queue_event_ttl_s) and self.queue_event_ttl_s > 0):
            raise ValueError(f"--queue-event-ttl: must be > 0; got {self.queue_event_ttl_s}")
        if not (math.isfinite(self.queue_retention_s) and self.queue_retention_s > 0):
            raise ValueError(f"--queue-retention: must be > 0; got {self.queue_retention_s}")


def bind_rest_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The REST listening socket, bound now (so a taken port fails before the model loads, and
    port 0 is resolved). `OSError` names the flag and the address. `reuse_port`: several
    routers on one host share the port (SO_REUSEPORT; the kernel spreads connections)."""
    sock = _bind("--port", host, port, reuse_port)
    sock.set_inheritable(True)
    return sock


def check_grpc_port(host: str, port: int) -> None:
    """Fail early (`OSError` naming the flag) when the gRPC port is taken. gRPC binds its own
    socket later, so a port taken in between still fails then, at startup."""
    if port != 0:
        _bind("--grpc-port", host, port).close()


def _bind(flag: str, host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"{flag}: cannot bind {host}:{port}: {e.strerror or e}") from e
    return sock


class RouterServer(uvicorn.Server):
    """uvicorn's server plus the gRPC server and the bounded drain described above."""

    def __init__(
        self,
        engine: EngineClient,
        served_model_name: str | Sequence[str],
        config: RouterConfig,
        rest_socket: socket.socket,
    ) -> None:
        self.engine = engine
        self.router_config = config
        self.rest_socket = rest_socket
        self.session_store = open_session_store(config.session_store_url)
        self.rate_limiter = open_rate_limiter(config.session_store_url)
        self.work_queue = open_work_queue(
            config.queue_url or config.session_store_url,
            lease_s=config.queue_lease_s,
            max_deliveries=config.queue_max_deliveries,
            event_ttl_s=config.queue_event_ttl_s,
            retention_s=config.queue_retention_s,
        )
        self.tracer_provider = (
            otlp_tracer_provider(config.otlp_endpoint) if config.otlp_endpoint else None
        )
        self.grpc_server: grpc.aio.Server | None = None
        self.grpc_port: int | None = None
        options = RouterOptions(
            api_keys=config.api_keys,
            max_queued_requests=config.max_queued_requests,
            max_queue_wait_s=config.max_queue_wait_s,
            session_store=self.session_store,
            rate_limiter=self.rate_limiter,
            rate_limits=config.rate_limits,
            work_queue=self.work_queue,
            chat_options=config.chat_options,
            embedding_pooling=config.embedding_pooling,
            web_ui=config.web_ui,
            metrics_prefix=config.metrics_prefix,
            metrics_open=config.metrics_open,
            tracer_provider=self.tracer_provider,
            http_limits=config.http_limits,
        )
        # One front door for REST and gRPC: one admission queue, one session manager, ...
        self.front = FrontDoor.compose(engine, served_model_name, options)
        self.admission = self.front.ctx.admission
        app = build_app(self.front, self._lifespan)
        super().__init__(
            uvicorn.Config(
                app,
                log_level="info",
                lifespan="on",
                # Header deadline and connection cap: uvicorn has neither (http_limits.py).
                http=bounded_h11_protocol(config.http_limits),
                # NOTE: a backstop only: `shutdown` ends in-flight requests after the drain.
                timeout_graceful_shutdown=int(config.shutdown_timeout_s + _BACKSTOP_S),
            )
        )

    def run(self) -> None:  # type: ignore[override]
        """Serve until Ctrl-C or SIGTERM (then re-raised by uvicorn, as KeyboardInterrupt for
        Ctrl-C), blocking the calling thread."""
        super().run(sockets=[self.rest_socket])

    @asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        config = self.router_config
        try:
            await self.engine.start()
            self.grpc_server, self.grpc_port = await start_grpc_server(
                self.front, config.host, config.grpc_port
            )
        except Exception:
            await self._close_stores()
            raise
        host, port = self.rest_socket.getsockname()[:2]
        keys = "required" if config.api_keys else "not required"
        logger.info(
            "REST API (OpenAI-compatible) for model %s on http://%s:%d/v1 (API key %s)",
            " / ".join(repr(n) for n in self.front.ctx.model_names), host, port, keys,
        )  # fmt: skip
        logger.info("gRPC API (%s) on %s:%d", SERVICE_NAME, config.host, self.grpc_port)
        store = self.session_store
        where = f"SQLite file {store.path}" if isinstance(store, SqliteSessionStore) else "Redis"
        logger.info("sessions stored in %s", where)  # NOTE: never the URL: it may hold a password
        queue = self.work_queue
        where = f"SQLite file {queue.path}" if isinstance(queue, SqliteWorkQueue) else "Redis"
        logger.info("work queue (Batch API) in %s", where)
        limits = config.rate_limits
        if not limits.is_unlimited:
            rpm, tpm = limits.requests_per_min, limits.tokens_per_min
            logger.info(
                "rate limits per API key: %s requests/min, %s tokens/min",
                "unlimited" if rpm is None else f"{rpm:g}",
                "unlimited" if tpm is None else f"{tpm:g}",
            )
        try:
            yield
        finally:
            if self.grpc_server is not None:
                await self.grpc_server.stop(0)  # already drained by `shutdown`; a no-op then
            await self.engine.stop()
            await self._close_stores()
            if self.tracer_provider is not None:  # exports what is still batched
                await asyncio.to_thread(self.tracer_provider.shutdown)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn stops accepting, waits for open connections, then runs the lifespan's exit;
        # the drain runs beside it and bounds the wait for REST and gRPC alike.
        drain = asyncio.create_task(self._drain())
        try:
            await super().shutdown(sockets)
        finally:
            await drain

    async def _drain(self) -> None:
        timeout_s = self.router_config.shutdown_timeout_s
        grpc_stopped = (
            asyncio.create_task(self.grpc_server.stop(timeout_s + _BACKSTOP_S))
            if self.grpc_server is not None
            else None
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        await asyncio.sleep(0.05)  # uvicorn closes idle connections; gRPC may stop at once
        while self.server_state.connections or (grpc_stopped and not grpc_stopped.done()):
            if loop.time() >= deadline:
                logger.warning(
                    "shutdown timeout (%gs) reached with requests in flight: stopping the "
                    "engine, which ends them with a retryable error", timeout_s,
                )  # fmt: skip
                # Blocks until the engine thread exits (one step at most): off the event loop.
                await asyncio.to_thread(self.engine.shutdown)
                break
            await asyncio.sleep(0.05)
        if grpc_stopped is not None:
            await grpc_stopped

    async def _close_stores(self) -> None:
        for closable in (self.session_store, self.rate_limiter, self.work_queue):
            try:
                await closable.close()
            except Exception as e:  # closing must not hide why we stopped
                logger.warning("closing %s failed: %s", type(closable).__name__, e)
