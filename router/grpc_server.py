"""The public gRPC service `duet.v1.Duet` (plus standard health checking and reflection), on an
`EngineClient` (one engine, or the cluster). Same validation, API keys (`router.auth.APIKeyChecker`), sessions
(`router.sessions`) and rate limits (`router.rate_limit`) as REST; errors map to status codes:

    bad field -> INVALID_ARGUMENT   missing/wrong key -> UNAUTHENTICATED
    unknown model or session -> NOT_FOUND   concurrent turn on a session -> ABORTED
    rate limited -> RESOURCE_EXHAUSTED   queue full / engine down / store down -> UNAVAILABLE

RESOURCE_EXHAUSTED and UNAVAILABLE carry `retry-after` (seconds) in the trailing metadata
when the server knows when to retry.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any, NoReturn, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from duet.engine import InvalidInputError, RequestOutput, SamplingParams, StructuredOutputsParams
from duet.engine.async_engine import EngineDeadError
from duet.router.admission import AdmissionController
from duet.router.auth import APIKeyChecker
from duet.router.engine_client import EngineClient
from duet.router.errors import (
    AuthenticationError,
    BadRequestError,
    ModelNotFoundError,
    OpenAIError,
)
from duet.router.grpc_chat import chat_body, piece_fields
from duet.router.grpc_logprobs import logprobs_to_proto, prompt_logprobs_to_proto
from duet.router.grpc_metrics import GrpcMetricsInterceptor
from duet.router.metrics import ServingMetrics
from duet.router.openai_chat import ChatOptions, ChatPlan, reply_message
from duet.router.rate_limit import NO_RATE_LIMITS, RequestRateLimiter
from duet.router.serving_context import check_priority
from duet.router.sessions import SessionManager, SessionTurn
from duet.router.tool_stream import Piece
from duet.router.tracing import RequestTracing, traced_outputs
from duet.session_store import RateLimiter, RateLimits, SessionStore
from duet.v1 import serving_pb2, serving_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["Duet"].full_name
_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")

_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ABORTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
"""REST statuses of `OpenAIError`s -> gRPC codes; anything else is INTERNAL."""


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer KEY` on every method but health and reflection."""

    def __init__(self, checker: APIKeyChecker) -> None:
        self.checker = checker

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not self.checker.enabled or details.method.startswith(_OPEN_METHODS):
            return await continuation(details)
        try:
            self.checker.check(_authorization(details.invocation_metadata))
        except AuthenticationError as e:
            handler = await continuation(details)
            return _deny(e.message, streaming=bool(handler and handler.response_streaming))
        return await continuation(details)


def _authorization(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    value = dict(metadata or ()).get("authorization")
    return value if isinstance(value, str) else None


def _deny(message: str, streaming: bool) -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


def sampling_params_from_proto(opts: serving_pb2.SamplingOptions) -> SamplingParams:
    """Unset optional fields keep the engine's defaults; bad values raise InvalidInputError."""
    kwargs: dict[str, Any] = {}
    for name in (
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "logprobs", "n", "min_tokens", "prompt_logprobs",
    ):  # fmt: skip
        if opts.HasField(name):
            kwargs[name] = getattr(opts, name)
    if opts.HasField("structured_outputs"):
        so = opts.structured_outputs
        kind = so.WhichOneof("kind")
        value: Any = list(so.choice.choices) if kind == "choice" else getattr(so, kind or "json")
        spec = {kind: value} if kind else {}
        kwargs["structured_outputs"] = StructuredOutputsParams(**spec, whitespace=so.any_whitespace)
    return SamplingParams(
        stop=list(opts.stop),
        stop_token_ids=list(opts.stop_token_ids),
        ignore_eos=opts.ignore_eos,
        **kwargs,
    )


class DuetServicer(serving_pb2_grpc.DuetServicer):
    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        admission: AdmissionController | None = None,
        checker: APIKeyChecker | None = None,
        sessions: SessionManager | None = None,
        rate_limiter: RequestRateLimiter | None = None,
        chat_options: ChatOptions | None = None,
        tracing: RequestTracing | None = None,
    ) -> None:
        """`admission`: shared with the REST app of the same server; None: a queue of its own
        with the default (time-bounded) limit. `chat_options`: the tool-call and reasoning
        parsers, as REST's. `tracing`: REST's (router/tracing.py); None: no traces."""
        self.engine = engine
        self.model_name = model_name
        self.admission = admission or AdmissionController(lambda: engine.max_num_seqs)
        self.checker = checker or APIKeyChecker(())
        self.sessions = sessions or SessionManager(None)
        self.rate_limiter = rate_limiter or RequestRateLimiter(None, NO_RATE_LIMITS)
        self.chat_options = chat_options or ChatOptions()
        self.tracing = tracing or RequestTracing()

    async def ListModels(
        self, request: serving_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.ListModelsResponse:
        model = serving_pb2.Model(
            id=self.model_name,
            max_model_len=self.engine.max_model_len,
            owned_by="duet",
            deterministic=self.engine.deterministic,
        )
        return serving_pb2.ListModelsResponse(models=[model])

    async def Generate(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        try:
            self._check_model(request.model)
            params = sampling_params_from_proto(request.sampling)
            if request.WhichOneof("prompt") == "token_ids":
                prompt_ids = list(request.token_ids.ids)
                self.engine.tokenize_prompt(prompt_ids)  # validates the ids
            else:
                prompt_ids = self.engine.tokenize_prompt(request.text)[1]
            check_priority(self.engine, request.priority)
            stream = self._stream(
                prompt_ids, params, request.request_id, context, priority=request.priority
            )
            async for response in stream:
                yield response
        except Exception as e:
            await _abort(context, e, request.request_id)

    async def Chat(
        self, request: serving_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        try:
            self._check_model(request.model)
            body = chat_body(request)
            plan = ChatPlan.of(body, self.chat_options, self.engine.tokenizer)
            params = sampling_params_from_proto(request.sampling)
            check_priority(self.engine, body.priority)
            new_messages = [m.to_template_message() for m in body.messages]
            turn = None
            if request.session_id:
                if params.n != 1:
                    raise BadRequestError(
                        f"n: must be 1 with session_id (a session stores one reply per turn); "
                        f"got {params.n}",
                        param="n",
                    )
                turn = await self.sessions.begin_turn(request.session_id, self._caller(context))
            messages = new_messages if turn is None else [*turn.history, *new_messages]
            prompt_ids = plan.render(self.engine.tokenizer, body, messages)
            params = plan.sampling_params(params)
            stream = self._stream(
                prompt_ids, params, request.request_id, context, turn, new_messages, plan,
                body.priority,
            )  # fmt: skip
            async for response in stream:
                yield response
        except Exception as e:
            await _abort(context, e, request.request_id)

    def _caller(self, context: grpc.aio.ServicerContext) -> str | None:
        return self.checker.authenticate(_authorization(context.invocation_metadata()))

    def _check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise ModelNotFoundError(
                f"model: {model!r} is not served; available: {self.model_name}", param="model"
            )

    async def _stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        context: grpc.aio.ServicerContext,
        turn: SessionTurn | None = None,
        new_messages: Sequence[dict[str, Any]] = (),
        plan: ChatPlan | None = None,
        priority: int = 0,
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        """Admit and run one request. With a session, the sample's last chunk and the usage
        wait until the turn is stored, so a stream that ends OK always has its turn stored."""
        arrival_s = time.monotonic()
        if not self.engine.is_running:
            raise EngineDeadError("the engine is not running; retry later")
        max_tokens = self.engine.check_lengths(len(prompt_ids), params)
        num_tokens = len(prompt_ids) + max_tokens * params.n
        await self.rate_limiter.admit(self._caller(context), num_tokens)
        [ticket] = self.admission.admit([params.n])
        try:
            run = self._run(
                prompt_ids, params, request_id, turn, new_messages, plan, priority, arrival_s
            )
            async for response in run:
                yield response
        finally:
            ticket.release()

    async def _run(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        turn: SessionTurn | None,
        new_messages: Sequence[dict[str, Any]],
        plan: ChatPlan | None,
        priority: int,
        arrival_s: float,
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        # Closed on any exit (client gone, error), which aborts the engine request at once.
        stream = traced_outputs(
            self.tracing, arrival_s, self.model_name,
            lambda: cast(
                AsyncGenerator[RequestOutput, None],
                self.engine.generate(prompt_ids, params, request_id or None, priority),
            ),
        )  # fmt: skip
        replies = {i: plan.new_reply() for i in range(params.n)} if plan is not None else {}
        sent_logprobs: dict[int, int] = {}
        sent_prompt = False
        held: list[serving_pb2.GenerateResponse] = []
        pieces: list[Piece] = []  # sample 0's, which a session stores
        last = None
        async with aclosing(stream) as outputs:
            async for out in outputs:
                last = out
                for sample in out.outputs:
                    if not sample.delta_token_ids and not sample.finished:
                        continue
                    lps = []
                    if sample.logprobs is not None:
                        start = sent_logprobs.get(sample.index, 0)
                        lps = [logprobs_to_proto(lp) for lp in sample.logprobs[start:]]
                        sent_logprobs[sample.index] = len(sample.logprobs)
                    fields: dict[str, Any] = {"text": sample.delta_text}
                    finish_reason = sample.finish_reason
                    reply = replies.get(sample.index)
                    piece = Piece(content=sample.delta_text)
                    if reply is not None:
                        piece = reply.feed(sample.delta_text)
                        if sample.finished:
                            piece = piece.then(reply.finish())
                        fields = piece_fields(piece)
                        finish_reason = reply.finish_reason(finish_reason)
                    if sample.index == 0:
                        pieces.append(piece)
                    if out.prompt_logprobs is not None and not sent_prompt:
                        sent_prompt = True
                        fields["prompt_logprobs"] = prompt_logprobs_to_proto(
                            out.prompt_logprobs, params.prompt_logprobs or 0
                        )
                    response = serving_pb2.GenerateResponse(
                        request_id=out.request_id,
                        index=sample.index,
                        token_ids=sample.delta_token_ids,
                        finish_reason=finish_reason or "",
                        logprobs=lps,
                        **fields,
                    )
                    if turn is not None and sample.finished:
                        held.append(response)
                    else:
                        yield response
        if last is None:
            return
        if turn is not None:
            await self.sessions.commit_turn(turn, list(new_messages), reply_message(pieces))
        for response in held:
            yield response
        usage = serving_pb2.Usage(
            prompt_tokens=len(last.prompt_token_ids),
            completion_tokens=sum(len(o.token_ids) for o in last.outputs),
            cached_prompt_tokens=last.num_cached_tokens,
        )
        yield serving_pb2.GenerateResponse(request_id=last.request_id, usage=usage)


async def _abort(context: grpc.aio.ServicerContext, error: Exception, request_id: str) -> NoReturn:
    """End the call with the status that says what went wrong (INTERNAL only for our bugs)."""
    if isinstance(error, grpc.aio.AbortError):
        raise error  # already aborted
    if isinstance(error, InvalidInputError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    if isinstance(error, EngineDeadError):
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine stopped: {error}")
    if isinstance(error, OpenAIError):
        retry_after = error.headers.get("Retry-After")
        if retry_after is not None:
            context.set_trailing_metadata((("retry-after", retry_after),))
        code = _STATUS_CODES.get(error.status_code, grpc.StatusCode.INTERNAL)
        await context.abort(code, error.message)
    error_id = request_id or uuid.uuid4().hex
    logger.error("gRPC request %s failed", error_id, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request {error_id})")
    raise AssertionError("unreachable: context.abort raises")


async def start_grpc_server(
    engine: EngineClient,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 50051,
    api_keys: Sequence[str] = (),
    admission: AdmissionController | None = None,
    session_store: SessionStore | None = None,
    rate_limiter: RateLimiter | None = None,
    rate_limits: RateLimits = NO_RATE_LIMITS,
    chat_options: ChatOptions | None = None,
    metrics: ServingMetrics | None = None,
    tracing: RequestTracing | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start serving in the running event loop; returns the server and the bound port (useful
    with port 0). The caller owns the engine, session store and rate limiter; the store and
    limiter must belong to this event loop (REST in the same process may share them).
    `metrics`, `tracing`: the REST app's (`app.state.serving`), to count calls by method and
    status (router/grpc_metrics.py) and trace requests; None: neither."""
    checker = APIKeyChecker(api_keys)
    interceptors: list[grpc.aio.ServerInterceptor] = [ApiKeyInterceptor(checker)]
    if metrics is not None:
        interceptors.insert(0, GrpcMetricsInterceptor(metrics, SERVICE_NAME))
    server = grpc.aio.server(interceptors=interceptors)
    servicer = DuetServicer(
        engine,
        model_name,
        admission,
        checker,
        SessionManager(session_store),
        RequestRateLimiter(rate_limiter, rate_limits),
        chat_options,
        tracing,
    )
    serving_pb2_grpc.add_DuetServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC: cannot bind {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("gRPC listening on %s:%d (service %s)", host, bound, SERVICE_NAME)
    return server, bound
