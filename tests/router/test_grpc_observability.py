"""The public gRPC API in metrics and traces: calls counted by method and final status code
in `duet:grpc_requests_total` (denied keys, unknown models and client errors included), and
each request that reaches the engine traced as one `duet.request` span, like REST's."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from duet.v1 import serving_pb2
from engine import AsyncEngine
from router.metrics import ServingMetrics
from router.tracing import RequestTracing
from tests.router.live_grpc import LiveGrpcServer, chat_request, collect_text
from tests.router.rest_server import API_KEY, MODEL_NAME

AUTH = (("authorization", f"Bearer {API_KEY}"),)


@pytest.fixture
def observed(
    rest_engine: AsyncEngine,
) -> Iterator[tuple[LiveGrpcServer, ServingMetrics, InMemorySpanExporter]]:
    metrics = ServingMetrics(rest_engine, MODEL_NAME)
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracing = RequestTracing(provider.get_tracer("test"))
    server = LiveGrpcServer(rest_engine, api_keys=[API_KEY], metrics=metrics, tracing=tracing)
    yield server, metrics, spans
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
