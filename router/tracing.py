"""Per-request tracing with OpenTelemetry (docs/observability.md).

One trace per request: a `duet.request` span at the router (arrival to last token) and, in
disaggregated mode, for each attempt that went through a prefill worker, `duet.prefill`
(prefill call sent to prefill done), `duet.kv_transfer` (prefill done to the decode side's
acknowledgement, with the bytes, chunks, the achieved bandwidth and its fraction of the probed
link rate) and `duet.decode` (KV in place to the attempt's last token), in that order. The
router builds these child spans when the request ends, from the prefill worker's answer (its
transfer time, bytes, chunks and link rate, worker.proto) and its own clock. The
`duet.request` span starts at arrival and its context goes to the workers in the metadata of
the request's calls (telemetry/request_trace.py), so workers that trace (`DUET_OTLP_ENDPOINT`,
telemetry/otel.py) add their own spans under it (telemetry/worker_spans.py).

Off (no `--otlp-endpoint`, no provider given): `RequestTracing.begin` returns None and nothing
else runs: no spans, no context, no exporter.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

from opentelemetry import trace

from duet.engine import RequestOutput
from duet.telemetry.otel import otlp_tracer_provider
from duet.telemetry.request_trace import REQUEST_TRACE, AttemptTiming, RequestTrace
from duet.telemetry.transfer_attributes import kv_transfer_attributes

__all__ = ["RequestTracing", "otlp_tracer_provider", "traced_outputs"]


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
        arrival_ns = _epoch_ns(arrival_s)
        root = self._tracer.start_span(
            "duet.request", start_time=arrival_ns, kind=trace.SpanKind.SERVER
        )
        return RequestTrace(arrival_ns, root)

    def finish(self, request: RequestTrace, attributes: dict[str, Any]) -> None:
        """Emit the request's spans, ending now."""
        assert self._tracer is not None
        end_ns = time.time_ns()
        root = request.root
        root.set_attributes(attributes)
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
        transfer = self._tracer.start_span(
            "duet.kv_transfer", context=parent, start_time=prefilled_ns,
            attributes={**common,
                        **kv_transfer_attributes(a.num_bytes, a.transfer_s, a.num_chunks,
                                                 a.link_gbps),
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


async def traced_outputs(
    tracing: RequestTracing,
    arrival_s: float,
    model_name: str,
    start: Callable[[], AsyncGenerator[RequestOutput, None]],
) -> AsyncGenerator[RequestOutput, None]:
    """The outputs of `start()` (an engine's `generate`), traced as one request when `tracing`
    is on (the gRPC API's requests; REST's are traced by `ServingContext.generate`)."""
    traced = tracing.begin(arrival_s)
    # The engine's tasks start in the first step and inherit this context.
    token = REQUEST_TRACE.set(traced) if traced is not None else None
    last: RequestOutput | None = None
    try:
        async with aclosing(start()) as outputs:
            async for out in outputs:
                if token is not None:
                    REQUEST_TRACE.reset(token)  # the same step that set it
                    token = None
                last = out
                yield out
    finally:
        if token is not None:
            REQUEST_TRACE.reset(token)
        if traced is not None:
            tracing.finish(traced, request_span_attributes(model_name, last))


def request_span_attributes(model_name: str, last: RequestOutput | None) -> dict[str, str | int]:
    """`duet.request`'s attributes from the request's last output (None: it produced none)."""
    attributes: dict[str, str | int] = {"duet.model": model_name}
    if last is not None:
        attributes["duet.request_id"] = last.request_id
        attributes["duet.prompt_tokens"] = len(last.prompt_token_ids)
        attributes["duet.generated_tokens"] = sum(len(c.token_ids) for c in last.outputs)
        attributes["duet.finish_reason"] = last.outputs[0].finish_reason or "abort"
    return attributes


def _epoch_ns(monotonic_s: float) -> int:
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)
