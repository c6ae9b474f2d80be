"""The public gRPC service `duet.v1.Duet` (plus standard health checking and reflection), on an
`AsyncEngine`. Same validation as REST, mapped to gRPC status codes:

    bad field -> INVALID_ARGUMENT   missing/wrong key -> UNAUTHENTICATED   unknown model -> NOT_FOUND
    queue full / engine down -> UNAVAILABLE   rate limited -> RESOURCE_EXHAUSTED
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from duet.v1 import serving_pb2, serving_pb2_grpc
from engine import AsyncEngine, InvalidInputError, SamplingParams
from engine.async_engine import EngineDeadError

logger = logging.getLogger(__name__)

SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["Duet"].full_name
_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer KEY` on every method but health and reflection."""

    def __init__(self, api_keys: Sequence[str]) -> None:
        self._keys = [k.encode() for k in api_keys]

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not self._keys or details.method.startswith(_OPEN_METHODS):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        auth = metadata.get("authorization", "")
        token = auth[7:].encode() if isinstance(auth, str) and auth.startswith("Bearer ") else b""
        if any(hmac.compare_digest(token, key) for key in self._keys):
            return await continuation(details)
        handler = await continuation(details)
        return self._deny_stream if handler and handler.response_streaming else self._deny_unary


def sampling_params_from_proto(opts: serving_pb2.SamplingOptions) -> SamplingParams:
    """Unset optional fields keep the engine's defaults; bad values raise InvalidInputError."""
    kwargs: dict[str, Any] = {}
    for name in (
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "logprobs", "n", "min_tokens",
    ):  # fmt: skip
        if opts.HasField(name):
            kwargs[name] = getattr(opts, name)
    return SamplingParams(
        stop=list(opts.stop),
        stop_token_ids=list(opts.stop_token_ids),
        ignore_eos=opts.ignore_eos,
        **kwargs,
    )


class DuetServicer(serving_pb2_grpc.DuetServicer):
    def __init__(
        self, engine: AsyncEngine, model_name: str, max_queued_requests: int = 256
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_queued_requests = max_queued_requests

    async def ListModels(
        self, request: serving_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.ListModelsResponse:
        model = serving_pb2.Model(
            id=self.model_name, max_model_len=self.engine.engine.max_model_len, owned_by="duet"
        )
        return serving_pb2.ListModelsResponse(models=[model])

    async def Generate(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        await self._check_model(request.model, context)
        which = request.WhichOneof("prompt")
        prompt: str | list[int]
        if which == "token_ids":
            prompt = list(request.token_ids.ids)
        else:
            prompt = request.text
        async for response in self._stream(prompt, request.sampling, request.request_id, context):
            yield response

    async def Chat(
        self, request: serving_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        await self._check_model(request.model, context)
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            prompt = self.engine.engine.encode_chat(messages)
        except InvalidInputError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        async for response in self._stream(prompt, request.sampling, request.request_id, context):
            yield response

    async def _check_model(self, model: str, context: grpc.aio.ServicerContext) -> None:
        if model and model != self.model_name:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"model: {model!r} is not served; available: {self.model_name}",
            )

    async def _stream(
        self,
        prompt: str | list[int],
        options: serving_pb2.SamplingOptions,
        request_id: str,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        if not self.engine.is_running:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is not running; retry later")
        if self.engine.engine.stats.num_waiting >= self.max_queued_requests:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "server overloaded: request queue is full"
            )
        try:
            params = sampling_params_from_proto(options)
            stream = self.engine.generate(prompt, params, request_id or None)
            sent_logprobs: dict[int, int] = {}
            last = None
            async for out in stream:
                last = out
                for sample in out.outputs:
                    if not sample.delta_token_ids and not sample.finished:
                        continue
                    lps = []
                    if sample.logprobs is not None:
                        start = sent_logprobs.get(sample.index, 0)
                        lps = [_logprobs_to_proto(lp) for lp in sample.logprobs[start:]]
                        sent_logprobs[sample.index] = len(sample.logprobs)
                    yield serving_pb2.GenerateResponse(
                        request_id=out.request_id,
                        index=sample.index,
                        text=sample.delta_text,
                        token_ids=sample.delta_token_ids,
                        finish_reason=sample.finish_reason or "",
                        logprobs=lps,
                    )
            if last is not None:
                usage = serving_pb2.Usage(
                    prompt_tokens=len(last.prompt_token_ids),
                    completion_tokens=sum(len(o.token_ids) for o in last.outputs),
                    cached_prompt_tokens=last.num_cached_tokens,
                )
                yield serving_pb2.GenerateResponse(request_id=last.request_id, usage=usage)
        except InvalidInputError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine stopped: {e}")


def _logprobs_to_proto(lp: Any) -> serving_pb2.TokenLogprobs:
    def one(x: Any) -> serving_pb2.TokenLogprob:
        return serving_pb2.TokenLogprob(token_id=x.token_id, logprob=x.logprob, token=x.token)

    return serving_pb2.TokenLogprobs(sampled=one(lp.sampled), top=[one(t) for t in lp.top])


async def start_grpc_server(
    engine: AsyncEngine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 50051,
    api_keys: Sequence[str] = (),
    max_queued_requests: int = 256,
) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the server and the bound port (useful with port 0)."""
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(api_keys)])
    serving_pb2_grpc.add_DuetServicer_to_server(
        DuetServicer(engine, model_name, max_queued_requests), server
    )
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
