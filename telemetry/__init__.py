"""OpenTelemetry plumbing shared by the router and the workers: the OTLP exporter, the W3C
trace context carried in gRPC metadata, and the workers' spans (docs/observability.md)."""
