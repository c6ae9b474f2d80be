"""Per-request traces: a disaggregated request exported over OTLP to an in-process collector
is one trace with router, prefill, KV-transfer and decode spans, in order, the transfer's
bytes on its span; without a provider nothing is traced."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from router.tracing import REQUEST_TRACE, RequestTracing, otlp_tracer_provider
from tests.router.cluster_server import ClusterServer
from tests.router.rest_server import API_KEY, MODEL_NAME
from tests.waiting import wait_for

BLOCK_BYTES = 2 * 2 * 8 * 2 * 16 * 4  # K and V x layers x block x kv heads x head dim x fp32


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector in this process."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        with self._lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector() -> Iterator[tuple[Collector, int]]:
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


def _attributes(span: Span) -> dict[str, object]:
    out: dict[str, object] = {}
    for kv in span.attributes:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which) if which else None
    return out


def test_a_disaggregated_request_is_one_trace_in_order(
    tiny_llama: str, collector: tuple[Collector, int]
) -> None:
    spans, port = collector
    provider = otlp_tracer_provider(f"127.0.0.1:{port}")
    server = ClusterServer(tiny_llama, app_args={"tracer_provider": provider}, threshold=0).start()
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as client:
            reply = client.completions.create(
                model=MODEL_NAME, prompt=list(range(3, 43)), max_tokens=5,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
        assert reply.usage is not None and reply.usage.completion_tokens == 5
        provider.force_flush(10_000)
        wait_for(lambda: len(spans.spans) >= 4, 10, "the request's spans at the collector")
    finally:
        server.stop()
        provider.shutdown()

    got = sorted(spans.spans, key=lambda s: (s.start_time_unix_nano, s.name != "duet.request"))
    assert [s.name for s in got] == [
        "duet.request",
        "duet.prefill",
        "duet.kv_transfer",
        "duet.decode",
    ]
    root, prefill, transfer, decode = got
    assert {s.trace_id for s in got} == {root.trace_id}
    assert root.parent_span_id == b""
    assert [s.parent_span_id for s in got[1:]] == [root.span_id] * 3
    # In order, each within the request: prefill, then the transfer, then decode.
    assert root.start_time_unix_nano <= prefill.start_time_unix_nano
    assert prefill.end_time_unix_nano == transfer.start_time_unix_nano
    assert transfer.end_time_unix_nano == decode.start_time_unix_nano
    assert transfer.end_time_unix_nano > transfer.start_time_unix_nano
    assert decode.end_time_unix_nano <= root.end_time_unix_nano
    attrs = _attributes(transfer)
    assert attrs["duet.kv_transfer.bytes"] == 5 * BLOCK_BYTES  # 40 prompt tokens: 5 blocks of 8
    assert attrs["duet.kv_transfer.status"] == "done"
    assert attrs["duet.kv_transfer.source"] == "p0"
    assert attrs["duet.kv_transfer.destination"] == "d0"
    assert float(attrs["duet.kv_transfer.gbps"]) > 0  # type: ignore[arg-type]
    root_attrs = _attributes(root)
    assert (root_attrs["duet.prompt_tokens"], root_attrs["duet.generated_tokens"]) == (40, 5)
    assert _attributes(prefill)["duet.worker"] == "p0"
    assert _attributes(decode)["duet.worker"] == "d0"


def test_without_a_provider_nothing_is_traced() -> None:
    tracing = RequestTracing()
    assert not tracing.enabled
    assert tracing.begin(0.0) is None
    assert REQUEST_TRACE.get() is None
