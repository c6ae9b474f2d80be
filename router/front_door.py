"""`FrontDoor`: the router's services, composed once by constructor injection and shared by
its transports (the REST app, router/api_server.py; the gRPC server, router/grpc_server.py):
one admission queue, one session manager, one rate limiter, one set of chat turns, and with a
work queue the Batch API and background requests with their queue consumers.

`RouterOptions` is how it serves (`duet serve`'s router flags, router/server.py; tests set the
parts they need)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry.sdk.trace import TracerProvider

from duet.router.admission import DEFAULT_MAX_QUEUE_WAIT_S, AdmissionController
from duet.router.auth import APIKeyChecker
from duet.router.background import KIND as BACKGROUND_KIND
from duet.router.background import BackgroundService
from duet.router.batch_runner import BatchPriority, BatchRunner
from duet.router.batches import BatchService
from duet.router.chat_turn import ChatTurns
from duet.router.conversations import ConversationsHandler
from duet.router.engine_client import EngineClient
from duet.router.http_limits import HttpLimits
from duet.router.openai_chat import ChatOptions
from duet.router.queue_worker import QueueWorker, RetryBackoff
from duet.router.rate_limit import NO_RATE_LIMITS, RequestRateLimiter
from duet.router.responses_background import KIND as RESPONSES_KIND
from duet.router.responses_background import ResponsesBackground
from duet.router.responses_store import StoredResponses
from duet.router.serving_chat import ChatCompletionHandler
from duet.router.serving_completion import CompletionHandler
from duet.router.serving_context import ServingContext
from duet.router.serving_embeddings import EmbeddingHandler
from duet.router.serving_responses import ResponsesHandler
from duet.router.sessions import SessionManager
from duet.router.tracing import RequestTracing
from duet.session_store import RateLimiter, RateLimits, SessionStore, WorkQueue


@dataclass(frozen=True)
class RouterOptions:
    """How the front door serves. The caller owns the session store, rate limiter and work
    queue, and closes them after the servers stop."""

    api_keys: Sequence[str] = ()
    """Keys every route but the probes (and the pages, with `web_ui`) requires; none: open."""
    max_queued_requests: int | None = None
    """A fixed admission queue bound; None: the time-bounded default (router/admission.py)."""
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S
    """The time bound of the default queue."""
    session_store: SessionStore | None = None
    """Sessions (None: session routes and `session_id` answer 404)."""
    rate_limiter: RateLimiter | None = None
    rate_limits: RateLimits = NO_RATE_LIMITS
    work_queue: WorkQueue | None = None
    """The Batch API and background requests, and this replica's consumers of their queues."""
    batch_priority: BatchPriority | None = None
    """How much of the engine batch lines may take; None: `BatchPriority()`."""
    queue_backoff: RetryBackoff | None = None
    """How queued work waits out a passing outage (router/queue_worker.py); None: the
    default."""
    chat_options: ChatOptions | None = None
    """Tool-call and reasoning parsers (router/openai_chat.py); None: inferred, none."""
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    """Bounds on one HTTP client: body size and read timeouts, connections
    (router/http_limits.py; the connection cap and header deadline are the server's)."""
    web_ui: bool = True
    """The chat page at `/` and the cluster dashboard (router/web_ui.py)."""
    metrics_prefix: str = "duet"
    """`duet`, or `vllm` to add vLLM's metric names (router/metrics.py)."""
    metrics_open: bool = False
    """`GET /metrics` answers without an API key (what Prometheus scrapers and autoscalers
    send: none), beside the probes."""
    tracer_provider: TracerProvider | None = None
    """Where each request's trace goes (router/tracing.py); None: no tracing."""
    embedding_pooling: str = "auto"
    """How `/v1/embeddings` pools a prompt's hidden states: `last`, `mean`, `cls`, or `auto`
    (what the model's sentence-transformers configuration declares, else `last`)."""


@dataclass
class FrontDoor:
    """The composed services (see the module's docstring)."""

    options: RouterOptions
    ctx: ServingContext
    checker: APIKeyChecker
    turns: ChatTurns
    chat: ChatCompletionHandler
    completions: CompletionHandler
    embeddings: EmbeddingHandler
    responses: ResponsesHandler
    conversations: ConversationsHandler
    batches: BatchService | None = None
    background: BackgroundService | None = None
    workers: list[QueueWorker] = field(default_factory=list)
    """The queue consumers the app's lifespan runs: batch lines, then background requests."""

    @classmethod
    def compose(
        cls, engine: EngineClient, served_model_name: str | Sequence[str], options: RouterOptions
    ) -> FrontDoor:
        """`served_model_name`: the id clients send, or several (the first is the one
        responses carry)."""
        admission = AdmissionController(
            lambda: engine.max_num_seqs,
            options.max_queued_requests,
            max_queue_wait_s=options.max_queue_wait_s,
        )
        tracer = (
            options.tracer_provider.get_tracer("duet.router") if options.tracer_provider else None
        )
        ctx = ServingContext(
            engine, served_model_name, admission, SessionManager(options.session_store),
            RequestRateLimiter(options.rate_limiter, options.rate_limits), options.chat_options,
            options.metrics_prefix, RequestTracing(tracer),
        )  # fmt: skip
        turns = ChatTurns(ctx)
        stored = StoredResponses(ctx.sessions)
        conversations = ConversationsHandler(ctx.sessions)
        batches = background = responses_background = None
        workers = []
        if options.work_queue is not None:
            queue, priority = options.work_queue, options.batch_priority or BatchPriority()
            batches = BatchService(queue, ctx.model_names)
            background = BackgroundService(queue.queue_named("background"), turns)
            responses_background = ResponsesBackground(
                background.queue, turns, stored, conversations
            )
            workers = [
                QueueWorker(queue, BatchRunner(ctx, batches, options.embedding_pooling).runners,
                            lambda num_running: priority.free_slots(admission, num_running),
                            backoff=options.queue_backoff),
                # Background requests are interactive work that outlives its connection: their
                # own queue (never behind a batch), taken whenever admission has room.
                QueueWorker(background.queue, {BACKGROUND_KIND: background.run,
                                               RESPONSES_KIND: responses_background.run},
                            lambda num_running: max(0, admission.max_running - num_running)
                            if admission.can_admit(1) else 0, backoff=options.queue_backoff),
            ]  # fmt: skip
        return cls(
            options, ctx, APIKeyChecker(options.api_keys), turns,
            ChatCompletionHandler(turns, background), CompletionHandler(ctx),
            EmbeddingHandler(ctx, options.embedding_pooling),
            ResponsesHandler(turns, stored, responses_background, conversations), conversations,
            batches, background, workers,
        )  # fmt: skip
