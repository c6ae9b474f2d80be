"""A load generator for OpenAI-compatible servers: what `duet bench serve` runs.

Seeded workloads (`workload`), one streamed request timed at the client (`client`), the
aggregates of a run (`metrics`), its figure (`plot`), the flags (`args`) and the run itself
(`benchmark`). Part of the product (the CLI imports it); `benchmarks/` may import it too.
"""
