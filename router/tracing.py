"""Per-request tracing with OpenTelemetry (docs/observability.md).

One trace per request: a `duet.request` span at the router (arrival to last token) and, in
disaggregated mode, for each attempt that went through a prefill worker, `duet.prefill`
(prefill call sent to prefill done), `duet.kv_transfer` (prefill done to the decode side's
acknowledgement, with the bytes and the achieved bandwidth) and `duet.decode` (KV in place to
the attempt's last token), in that order. The router builds the child spans when the request
ends, from the prefill worker's answer (its transfer time and bytes, worker.proto) and its own
clock, so workers need no tracing setup and no clocks need to agree.

Off (no `--otlp-endpoint`, no provider given): `RequestTracing.begin` returns None and nothing
else runs: no spans, no context, no exporter.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

REQUEST_TRACE: ContextVar[RequestTrace | None] = ContextVar("duet_request_trace", default=None)
"""The trace of the request whose engine tasks run in this context (set by the router around
the start of `EngineClient.generate`, so the cluster engine's tasks inherit it)."""


@dataclass
class AttemptTiming:
    """One attempt's way through a prefill worker, a KV transfer and a decode worker (wall
    clock, ns since the epoch)."""

    transfer_id: str
    prefill_worker: str
    decode_worker: str
    num_prompt_tokens: int
    call_ns: int
    answer_ns: int | None = None
    end_ns: int | None = None
    status: str = ""
    reason: str = ""
    num_bytes: int = 0
    transfer_s: float = 0.0
    num_cached_tokens: int = 0


@dataclass
class RequestTrace:
    arrival_ns: int
    attempts: list[AttemptTiming] = field(default_factory=list)


class RequestTracing:
    """Makes a request's spans with `tracer`; with None, does nothing."""

    def __init__(self, tracer: trace.Tracer | None = None) -> None:
        self._tracer = tracer

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def begin(self, arrival_s: float) -> RequestTrace | None:
        """A trace for a request that arrived at `arrival_s` (time.monotonic)."""
        if self._tracer is None:
            return None
        return RequestTrace(_epoch_ns(arrival_s))

    def finish(self, request: RequestTrace, attributes: dict[str, Any]) -> None:
        """Emit the request's spans, ending now."""
        assert self._tracer is not None
        end_ns = time.time_ns()
        root = self._tracer.start_span(
            "duet.request", start_time=request.arrival_ns, attributes=attributes,
            kind=trace.SpanKind.SERVER,
        )  # fmt: skip
        parent = trace.set_span_in_context(root)
        for a in request.attempts:
            self._attempt_spans(a, parent, end_ns)
        root.end(end_time=end_ns)

    def _attempt_spans(self, a: AttemptTiming, parent: Any, end_ns: int) -> None:
        assert self._tracer is not None
        answer_ns = a.answer_ns if a.answer_ns is not None else (a.end_ns or end_ns)
        acked_ns = max(a.call_ns, answer_ns)
        prefilled_ns = max(a.call_ns, acked_ns - int(a.transfer_s * 1e9))
        common = {"duet.transfer_id": a.transfer_id}
        prefill = self._tracer.start_span(
            "duet.prefill", context=parent, start_time=a.call_ns,
            attributes={**common, "duet.worker": a.prefill_worker,
                        "duet.prompt_tokens": a.num_prompt_tokens,
                        "duet.cached_tokens": a.num_cached_tokens},
        )  # fmt: skip
        prefill.end(end_time=prefilled_ns)
        gbps = a.num_bytes / a.transfer_s / 1e9 if a.transfer_s > 0 else 0.0
        transfer = self._tracer.start_span(
            "duet.kv_transfer", context=parent, start_time=prefilled_ns,
            attributes={**common, "duet.kv_transfer.bytes": a.num_bytes,
                        "duet.kv_transfer.duration_s": a.transfer_s,
                        "duet.kv_transfer.gbps": gbps,
                        "duet.kv_transfer.status": a.status or "unknown",
                        "duet.kv_transfer.reason": a.reason,
                        "duet.kv_transfer.source": a.prefill_worker,
                        "duet.kv_transfer.destination": a.decode_worker},
        )  # fmt: skip
        if a.status == "failed":
            transfer.set_status(trace.StatusCode.ERROR, a.reason)
        transfer.end(end_time=acked_ns)
        decode = self._tracer.start_span(
            "duet.decode", context=parent, start_time=acked_ns,
            attributes={**common, "duet.worker": a.decode_worker},
        )  # fmt: skip
        decode.end(end_time=max(acked_ns, a.end_ns or end_ns))


def otlp_tracer_provider(endpoint: str, service_name: str = "duet-router") -> TracerProvider:
    """A provider exporting over OTLP/gRPC to `endpoint` (host:port, or http(s)://host:port;
    plain host:port is insecure, for a collector beside the router), batched off the
    serving path."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    insecure = not endpoint.startswith("https://")
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _epoch_ns(monotonic_s: float) -> int:
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)
