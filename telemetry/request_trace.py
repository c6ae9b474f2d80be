"""The trace of one request as it crosses processes (docs/observability.md): the router opens
its `duet.request` span (router/tracing.py) and sets `REQUEST_TRACE` around the start of the
request; the control plane's tasks inherit the context, send the span's context to the workers
with each call (`request_trace_metadata`) and note each attempt's way through a prefill worker,
a KV transfer and a decode worker (`AttemptTiming`), from which the router builds the child
spans when the request ends."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field

from opentelemetry import trace

from duet.telemetry.otel import trace_metadata

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
    num_chunks: int = 0
    link_gbps: float = 0.0  # 0: not measured


@dataclass
class RequestTrace:
    arrival_ns: int
    root: trace.Span
    """`duet.request`, open from arrival until `RequestTracing.finish`."""
    attempts: list[AttemptTiming] = field(default_factory=list)


def request_trace_metadata() -> tuple[tuple[str, str], ...]:
    """gRPC metadata for a worker call made for the traced request of this context (its
    `duet.request` span's context); empty when the request is not traced."""
    traced = REQUEST_TRACE.get()
    return trace_metadata(traced.root) if traced is not None else ()
