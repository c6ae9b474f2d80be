"""Tracer providers and the W3C trace context in gRPC metadata.

The router exports with the provider `duet serve --otlp-endpoint` builds; a worker exports
with one built from `DUET_OTLP_ENDPOINT` (set by the cluster launcher when the router traces),
once per process. The router puts its request span's context in the `traceparent` metadata
of the calls it makes for the request (Prefill, DecodeRemote, Generate); a worker that
traces makes its spans children of it. Without an endpoint nothing here runs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

OTLP_ENDPOINT_ENV = "DUET_OTLP_ENDPOINT"
"""A worker exports its spans over OTLP/gRPC to this collector (unset: the worker traces
nothing)."""

_PROPAGATOR = TraceContextTextMapPropagator()


def otlp_tracer_provider(endpoint: str, service_name: str = "duet-router") -> TracerProvider:
    """A provider exporting over OTLP/gRPC to `endpoint` (host:port, or http(s)://host:port;
    plain host:port is insecure, for a collector beside the process), batched off the
    serving path."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    insecure = not endpoint.startswith("https://")
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


@functools.cache
def worker_tracer_provider(endpoint: str, service_name: str) -> TracerProvider:
    """The process's provider for `service_name` exporting to `endpoint` (one per process:
    every server of that role in it shares its exporter)."""
    return otlp_tracer_provider(endpoint, service_name)


def worker_tracer(service_name: str) -> trace.Tracer | None:
    """The tracer a worker's server records its spans with: None unless `DUET_OTLP_ENDPOINT`
    is set."""
    endpoint = os.environ.get(OTLP_ENDPOINT_ENV)
    if not endpoint:
        return None
    return worker_tracer_provider(endpoint, service_name).get_tracer(service_name)


def trace_metadata(span: trace.Span | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying `span`'s context (`traceparent`); empty for None."""
    if span is None:
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return tuple(carrier.items())


def remote_parent(metadata: Sequence[tuple[str, Any]] | None) -> Context | None:
    """The caller's span context from a call's metadata; None when it sent none."""
    carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
    if "traceparent" not in carrier:
        return None
    context = _PROPAGATOR.extract(carrier)
    if not trace.get_current_span(context).get_span_context().is_valid:
        return None
    return context
