"""The public gRPC API in metrics and traces: calls counted by method and final status code
in `duet:grpc_requests_total` (denied keys, unknown models and client errors included), and
each request that reaches the engine traced as one `duet.request` span, like REST's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from duet.engine import AsyncEngine
from duet.router.grpc_metrics import GrpcMetricsInterceptor
from duet.router.metrics import ServingMetrics
from duet.v1 import serving_pb2
from tests.router.live_grpc import LiveGrpcServer, chat_request, collect_text
from tests.router.rest_server import API_KEY, MODEL_NAME

AUTH = (("authorization", f"Bearer {API_KEY}"),)


@pytest.fixture
def observed(
    rest_engine: AsyncEngine,
) -> Iterator[tuple[LiveGrpcServer, ServingMetrics, InMemorySpanExporter]]:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    server = LiveGrpcServer(rest_engine, api_keys=[API_KEY], tracer_provider=provider)
    yield server, server.front.ctx.metrics, spans
    server.stop()
    provider.shutdown()


def _count(metrics: ServingMetrics, method: str, code: str) -> float | None:
    return metrics.registry.get_sample_value(
        "duet:grpc_requests_total", {"model_name": MODEL_NAME, "method": method, "code": code}
    )


def test_calls_are_counted_by_method_and_code_and_traced(
    observed: tuple[LiveGrpcServer, ServingMetrics, InMemorySpanExporter],
) -> None:
    server, metrics, spans = observed
    stub = server.stub
    _, usage = collect_text(stub.Chat(chat_request("hi", max_tokens=4), metadata=AUTH))
    assert usage is not None and usage.completion_tokens == 4
    stub.ListModels(serving_pb2.ListModelsRequest(), metadata=AUTH)
    with pytest.raises(grpc.RpcError) as denied:
        list(stub.Chat(chat_request("hi"), metadata=(("authorization", "Bearer wrong"),)))
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as unknown:
        request = serving_pb2.GenerateRequest(model="nope", text="hi")
        list(stub.Generate(request, metadata=AUTH))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

    assert _count(metrics, "Chat", "OK") == 1
    assert _count(metrics, "ListModels", "OK") == 1
    assert _count(metrics, "Chat", "UNAUTHENTICATED") == 1
    assert _count(metrics, "Generate", "NOT_FOUND") == 1
    assert _count(metrics, "Generate", "OK") is None
    assert b'duet:grpc_requests_total{code="OK",method="Chat",model_name="' in metrics.render()

    # Only the request that ran has a trace: one root span with its token counts.
    finished = spans.get_finished_spans()
    assert [s.name for s in finished] == ["duet.request"]
    attrs = dict(finished[0].attributes or {})
    assert attrs["duet.generated_tokens"] == 4
    assert attrs["duet.finish_reason"] == "length"
    assert attrs["duet.model"] == MODEL_NAME
    assert finished[0].parent is None


def test_an_aborted_call_is_counted_before_its_status_goes_out(rest_engine: AsyncEngine) -> None:
    """`abort` sends the status before it raises, and a handler can still be running after it
    (here it cleans up for half a second): the count is made at the abort, so a client that
    has seen the status finds it counted."""
    metrics = ServingMetrics(rest_engine, MODEL_NAME)
    cleaned_up = asyncio.Event()

    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
        finally:
            await asyncio.sleep(0.5)
            cleaned_up.set()
        return b""

    async def main() -> tuple[grpc.StatusCode, float | None, bool]:
        server = grpc.aio.server(interceptors=[GrpcMetricsInterceptor(metrics, "test.Svc")])
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(
                "test.Svc", {"Find": grpc.unary_unary_rpc_method_handler(handler)}
            )]
        )  # fmt: skip
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as denied:
                    await channel.unary_unary("/test.Svc/Find")(b"", timeout=10)
                return (
                    denied.value.code(),
                    _count(metrics, "Find", "NOT_FOUND"),
                    (cleaned_up.is_set()),
                )
        finally:
            await server.stop(2)

    code, counted, handler_done = asyncio.run(main())
    assert code == grpc.StatusCode.NOT_FOUND
    assert not handler_done  # the client saw the status while the handler still ran
    assert counted == 1
