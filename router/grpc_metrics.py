"""`GrpcMetricsInterceptor`: requests of the public gRPC API (`duet.v1.Duet`) by method and
final status code in `duet:grpc_requests_total`, like `duet:http_responses_total` for REST
(router/http_metrics.py). Outermost of the server's interceptors, so the API key check's
UNAUTHENTICATED denials are counted; health checks and reflection are not."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, NoReturn

import grpc

from duet.router.metrics import ServingMetrics


class GrpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: ServingMetrics, service: str) -> None:
        """`service`: the full name of the service counted (`duet.v1.Duet`)."""
        self.metrics = metrics
        self._prefix = f"/{service}/"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        method = details.method.removeprefix(self._prefix)

        def count(context: _CountingContext, error: BaseException | None) -> None:
            context.count(_code_of(context.inner, error))

        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def unary_stream(
                request: Any, servicer_context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                context = _CountingContext(servicer_context, self.metrics, method)
                error: BaseException | None = None
                try:
                    responses = inner_stream(request, context)
                    if inspect.isawaitable(responses):  # a handler that writes (or only aborts)
                        await responses
                        return
                    async with aclosing(responses):
                        async for response in responses:
                            yield response
                except BaseException as e:
                    error = e
                    raise
                finally:  # before the status goes out, so a client that saw it finds it counted
                    count(context, error)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary_unary(request: Any, servicer_context: grpc.aio.ServicerContext) -> Any:
                context = _CountingContext(servicer_context, self.metrics, method)
                error: BaseException | None = None
                try:
                    return await inner_unary(request, context)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    count(context, error)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        return handler  # duet.v1.Duet has no client-streaming methods


class _CountingContext:
    """The handler's context, counting the call when the handler aborts it: `abort` sends the
    status before it raises, so a client could see the status before a count made after the
    handler ends. Everything else is the servicer context's."""

    def __init__(
        self, inner: grpc.aio.ServicerContext, metrics: ServingMetrics, method: str
    ) -> None:
        self.inner = inner
        self.counted = False
        self._metrics = metrics
        self._method = method

    def count(self, code: str) -> None:
        """Count the call with its final status code, once."""
        if not self.counted:
            self.counted = True
            self._metrics.count_grpc(self._method, code)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> NoReturn:
        self.count(code.name)
        await self.inner.abort(code, details, trailing_metadata)
        raise AssertionError("unreachable: abort raises")  # for the type checker

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _code_of(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """The call's status: what `abort` or `set_code` set, else from how the handler ended."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # the core's enum value
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), "UNKNOWN")
    if error is None:
        return grpc.StatusCode.OK.name
    if isinstance(error, asyncio.CancelledError) or context.cancelled():
        return grpc.StatusCode.CANCELLED.name
    return grpc.StatusCode.UNKNOWN.name  # an unexpected exception
