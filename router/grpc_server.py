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

from duet.engine import InvalidInputError, RequestOutput, SamplingParams, StructuredOutputsParams
from duet.engine.async_engine import EngineDeadError
from duet.engine.llm_engine import Prompt
from duet.router.auth import APIKeyChecker
from duet.router.errors import (
    AuthenticationError,
    ModelNotFoundError,
    OpenAIError,
)
from duet.router.front_door import FrontDoor
from duet.router.grpc_chat import ChatResponses, chat_body
from duet.router.grpc_logprobs import logprobs_to_proto, prompt_logprobs_to_proto
from duet.router.grpc_metrics import GrpcMetricsInterceptor
from duet.router.grpc_reflection import enable_reflection
from duet.router.openai_protocol import truncate_prompt
from duet.router.serving_context import check_priority
from duet.router.tracing import traced_outputs
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
        "cache_salt",
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
        bad_words=list(opts.bad_words),
        ignore_eos=opts.ignore_eos,
        logit_bias=dict(opts.logit_bias) or None,
        allowed_token_ids=list(opts.allowed_token_ids) or None,
        include_stop_str_in_output=opts.include_stop_str_in_output,
        **kwargs,
    )


class DuetServicer(serving_pb2_grpc.DuetServicer):
    def __init__(self, front: FrontDoor) -> None:
        """Over the same services as the REST app of this server (router/front_door.py)."""
        self.front = front
        self.ctx = front.ctx
        self.turns = front.turns

    async def ListModels(
        self, request: serving_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.ListModelsResponse:
        models = [
            serving_pb2.Model(
                id=name,
                max_model_len=self.ctx.engine.max_model_len,
                owned_by="duet",
                deterministic=self.ctx.engine.deterministic,
            )
            for name in self.ctx.model_names
        ]
        return serving_pb2.ListModelsResponse(models=models)

    async def Generate(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        engine = self.ctx.engine
        # A fresh id when the client sends none: unique across requests, replicas and restarts.
        request_id = request.request_id or uuid.uuid4().hex
        try:
            self._check_model(request.model)
            params = sampling_params_from_proto(request.sampling)
            opts = request.sampling
            keep = opts.truncate_prompt_tokens if opts.HasField("truncate_prompt_tokens") else None
            if request.WhichOneof("prompt") == "token_ids":
                prompt_ids = list(request.token_ids.ids)
                engine.tokenize_prompt(prompt_ids)  # validates the ids
            else:
                prompt_ids = engine.tokenize_prompt(request.text, bounded=keep is None)[1]
            prompt_ids = truncate_prompt(prompt_ids, keep, engine.max_model_len)
            check_priority(engine, request.priority)
            stream = self._generate(prompt_ids, params, request_id, context, request.priority)
            async for response in stream:
                yield response
        except Exception as e:
            await _abort(context, e, request_id)

    async def Chat(
        self, request: serving_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        """One chat turn (router/chat_turn.py), as REST's, rendered as `GenerateResponse`s."""
        arrival_s = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            self._check_model(request.model)
            body = chat_body(request)
            plan, _ = self.turns.plan(body, {})
            params = sampling_params_from_proto(request.sampling)
            caller = self._caller(context)
            turn = await self.turns.open(body, plan, params, caller, request_id, {})
            [ticket] = self.ctx.admission.admit([turn.n])
            render = ChatResponses(request_id, params.prompt_logprobs or 0)
            try:
                # Closed on any exit (client gone, error), which aborts the engine request.
                async with aclosing(turn.steps(ticket, arrival_s)) as steps:
                    async for step in steps:
                        for response in render.of(step):
                            yield response
            finally:
                ticket.release()
        except Exception as e:
            await _abort(context, e, request_id)

    async def Embed(
        self, request: serving_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.EmbedResponse:
        """As REST's `/v1/embeddings` (router/serving_embeddings.py): floats, in input order."""
        request_id = request.request_id or uuid.uuid4().hex
        try:
            self._check_model(request.model)
            inputs: list[Prompt] = []
            for item in request.inputs:
                kind = item.WhichOneof("input")
                inputs.append(list(item.token_ids.ids) if kind == "token_ids" else item.text)
            keep = (
                request.truncate_prompt_tokens
                if request.HasField("truncate_prompt_tokens")
                else None
            )
            vectors, num_tokens = await self.front.embeddings.embed(
                inputs, self._caller(context), request_id, keep
            )
        except Exception as e:
            await _abort(context, e, request_id)
        return serving_pb2.EmbedResponse(
            request_id=request_id,
            embeddings=[serving_pb2.Embedding(values=v) for v in vectors],
            usage=serving_pb2.Usage(prompt_tokens=num_tokens),
        )

    def _caller(self, context: grpc.aio.ServicerContext) -> str | None:
        return self.front.checker.authenticate(_authorization(context.invocation_metadata()))

    def _check_model(self, model: str) -> None:
        if model and model not in self.ctx.model_names:
            raise ModelNotFoundError(
                f"model: {model!r} is not served; available: {', '.join(self.ctx.model_names)}",
                param="model",
            )

    async def _generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        context: grpc.aio.ServicerContext,
        priority: int,
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        """Admit and run one prompt (no chat template, no reply parsing): each sample's new
        text and tokens, then the usage."""
        arrival_s = time.monotonic()
        engine = self.ctx.engine
        if not engine.is_running:
            raise EngineDeadError("the engine is not running; retry later")
        max_tokens = engine.check_lengths(len(prompt_ids), params)
        num_tokens = len(prompt_ids) + max_tokens * params.n
        await self.ctx.rate_limiter.admit(self._caller(context), num_tokens)
        [ticket] = self.ctx.admission.admit([params.n])
        try:
            # Closed on any exit (client gone, error), which aborts the engine request at once.
            stream = traced_outputs(
                self.ctx.tracing, arrival_s, self.ctx.model_name,
                lambda: cast(
                    AsyncGenerator[RequestOutput, None],
                    engine.generate(prompt_ids, params, request_id, priority),
                ),
            )  # fmt: skip
            sent_logprobs: dict[int, int] = {}
            sent_prompt = False
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
                        response = serving_pb2.GenerateResponse(
                            request_id=out.request_id,
                            index=sample.index,
                            token_ids=sample.delta_token_ids,
                            text=sample.delta_text,
                            finish_reason=sample.finish_reason or "",
                            logprobs=lps,
                        )
                        if out.prompt_logprobs is not None and not sent_prompt:
                            sent_prompt = True
                            response.prompt_logprobs.extend(
                                prompt_logprobs_to_proto(
                                    out.prompt_logprobs, params.prompt_logprobs or 0
                                )
                            )
                        yield response
        finally:
            ticket.release()
        if last is None:
            return
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
    front: FrontDoor, host: str = "127.0.0.1", port: int = 50051
) -> tuple[grpc.aio.Server, int]:
    """Serve `front`'s services (shared with the REST app of the same server: admission,
    sessions, rate limits, metrics, traces) in the running event loop; returns the server and
    the bound port (useful with port 0). Calls are counted by method and status in the front
    door's metrics (router/grpc_metrics.py)."""
    interceptors: list[grpc.aio.ServerInterceptor] = [
        GrpcMetricsInterceptor(front.ctx.metrics, SERVICE_NAME),
        ApiKeyInterceptor(front.checker),
    ]
    server = grpc.aio.server(interceptors=interceptors)
    serving_pb2_grpc.add_DuetServicer_to_server(DuetServicer(front), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, (SERVICE_NAME, health.SERVICE_NAME))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC: cannot bind {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("gRPC listening on %s:%d (service %s)", host, bound, SERVICE_NAME)
    return server, bound
