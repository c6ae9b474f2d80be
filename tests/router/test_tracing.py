"""Per-request traces: a disaggregated request exported over OTLP to an in-process collector
is one trace with router, prefill, KV-transfer and decode spans, in order, the transfer's
bytes, chunks and achieved rate as a fraction of the probed link rate on its span, and the
prefill and decode workers' own spans under the router's request span (the trace context
travels in the gRPC metadata); without a provider nothing is traced."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from duet.kv_transfer import chunks
from duet.router.tracing import RequestTracing, otlp_tracer_provider
from duet.telemetry.otel import OTLP_ENDPOINT_ENV, worker_tracer_provider
from duet.telemetry.request_trace import REQUEST_TRACE
from tests.router.cluster_server import ClusterServer
from tests.router.rest_server import API_KEY, MODEL_NAME
from tests.waiting import wait_for

BLOCK_BYTES = 2 * 2 * 8 * 2 * 16 * 4  # K and V x layers x block x kv heads x head dim x fp32
NUM_LAYERS = 2


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

    def take(self) -> list[Span]:
        with self._lock:
            spans, self.spans = self.spans, []
        return spans


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


ROUTER_SPANS = ["duet.request", "duet.prefill", "duet.kv_transfer", "duet.decode"]
PREFILL_SPANS = ["duet.prefill_worker", "duet.prefill_worker.queue",
                 "duet.prefill_worker.compute", "duet.prefill_worker.kv_send"]  # fmt: skip
DECODE_SPANS = ["duet.decode_worker", "duet.decode_worker.kv_wait", "duet.decode_worker.decode"]


def test_a_disaggregated_request_is_one_trace_in_order(
    tiny_llama: str, collector: tuple[Collector, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    spans, port = collector
    endpoint = f"127.0.0.1:{port}"
    monkeypatch.setenv(OTLP_ENDPOINT_ENV, endpoint)  # what the cluster launcher sets
    monkeypatch.setattr(chunks, "CHUNK_MIN_BYTES", 1)  # layer-wise: one message per layer
    provider = otlp_tracer_provider(endpoint)
    server = ClusterServer(tiny_llama, app_args={"tracer_provider": provider}, threshold=0).start()

    def request_spans() -> list[Span]:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as client:
            reply = client.completions.create(
                model=MODEL_NAME, prompt=list(range(3, 43)), max_tokens=5,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
        assert reply.usage is not None and reply.usage.completion_tokens == 5
        provider.force_flush(10_000)
        for service in ("duet-prefill-worker", "duet-decode-worker"):
            worker_tracer_provider(endpoint, service).force_flush(10_000)
        wait_for(lambda: len(spans.spans) >= 11, 10, "the request's spans at the collector")
        return spans.take()

    try:
        # The first transfer to the decode worker starts the prefill worker's link probe,
        # which runs once that transfer has ended: its spans have no link rate.
        first = {s.name: _attributes(s) for s in request_spans()}
        for name in ("duet.kv_transfer", "duet.prefill_worker.kv_send"):
            assert first[name]["duet.kv_transfer.chunks"] == NUM_LAYERS
            assert "duet.kv_transfer.link_gbps" not in first[name]
            assert "duet.kv_transfer.link_fraction" not in first[name]
        assert server.cluster is not None
        sender, decode = server.cluster.prefill[0].sender, server.cluster.decode[0]
        link_gbps = wait_for(lambda: sender.link_gbps(decode.kv_address), 20, "the link probe")
        collected = request_spans()
    finally:
        server.stop()
        provider.shutdown()

    by_name = {s.name: s for s in collected}
    assert sorted(by_name) == sorted(ROUTER_SPANS + PREFILL_SPANS + DECODE_SPANS)
    assert len(collected) == 11
    got = [by_name[n] for n in ROUTER_SPANS]
    root, prefill, transfer, decode = got
    assert {s.trace_id for s in collected} == {root.trace_id}
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
    gbps = attrs["duet.kv_transfer.gbps"]
    assert isinstance(gbps, float) and gbps > 0
    # A message per layer, and the achieved rate as a fraction of the probed link's.
    assert attrs["duet.kv_transfer.chunks"] == NUM_LAYERS
    assert attrs["duet.kv_transfer.link_gbps"] == link_gbps > 0
    assert attrs["duet.kv_transfer.link_fraction"] == gbps / link_gbps
    root_attrs = _attributes(root)
    assert (root_attrs["duet.prompt_tokens"], root_attrs["duet.generated_tokens"]) == (40, 5)
    assert _attributes(prefill)["duet.worker"] == "p0"
    assert _attributes(decode)["duet.worker"] == "d0"

    # The workers' spans: each worker's request span is a child of the router's request span
    # (the context came in the call's metadata), its phases children of it, back to back.
    for names, worker in ((PREFILL_SPANS, "p0"), (DECODE_SPANS, "d0")):
        top, *phases = (by_name[n] for n in names)
        assert top.parent_span_id == root.span_id
        assert top.kind == Span.SpanKind.SPAN_KIND_SERVER
        assert [p.parent_span_id for p in phases] == [top.span_id] * len(phases)
        assert phases[0].start_time_unix_nano == top.start_time_unix_nano
        for a, b in itertools.pairwise(phases):
            assert a.end_time_unix_nano == b.start_time_unix_nano
        assert phases[-1].end_time_unix_nano <= top.end_time_unix_nano
        assert top.start_time_unix_nano >= root.start_time_unix_nano
        assert top.end_time_unix_nano <= root.end_time_unix_nano
        assert _attributes(top)["duet.worker"] == worker
        assert _attributes(top)["duet.request_id"] == _attributes(prefill)["duet.transfer_id"]
    kv_send = _attributes(by_name["duet.prefill_worker.kv_send"])
    assert kv_send["duet.kv_transfer.bytes"] == 5 * BLOCK_BYTES
    assert kv_send["duet.kv_transfer.chunks"] == NUM_LAYERS
    assert kv_send["duet.kv_transfer.link_gbps"] == link_gbps
    send_gbps = kv_send["duet.kv_transfer.gbps"]
    assert isinstance(send_gbps, float) and send_gbps > 0
    assert kv_send["duet.kv_transfer.link_fraction"] == send_gbps / link_gbps
    decode_top = _attributes(by_name["duet.decode_worker"])
    assert (decode_top["duet.generated_tokens"], decode_top["duet.finish_reason"]) == (5, "length")
    # The queue ends where the engine step that computed the prompt began (after the add).
    queue = by_name["duet.prefill_worker.queue"]
    assert queue.end_time_unix_nano > queue.start_time_unix_nano
    # The decode worker waits for the KV while the prefill worker computes and sends it.
    kv_wait = by_name["duet.decode_worker.kv_wait"]
    assert kv_wait.end_time_unix_nano >= by_name["duet.prefill_worker.compute"].end_time_unix_nano


def test_without_a_provider_nothing_is_traced() -> None:
    tracing = RequestTracing()
    assert not tracing.enabled
    assert tracing.begin(0.0) is None
    assert REQUEST_TRACE.get() is None


def test_the_ray_launcher_gives_workers_the_routers_collector() -> None:
    from duet.deploy.cluster_spec import ClusterSpec
    from duet.router.server import RouterConfig

    traced = ClusterSpec(router=RouterConfig(otlp_endpoint="collector:4317"))
    assert traced.worker_runtime_env() == {"env_vars": {OTLP_ENDPOINT_ENV: "collector:4317"}}
    assert ClusterSpec().worker_runtime_env() is None
