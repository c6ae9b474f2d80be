"""duet: a distributed, disaggregated prefill/decode LLM serving cluster.

Every part of duet imports under this one namespace: `duet.engine`, `duet.router`,
`duet.prefill_worker`, `duet.decode_worker`, `duet.kv_transfer`, `duet.session_store`,
`duet.deploy`, `duet.cli`, `duet.loadgen`, `duet.cluster_auth`, `duet.telemetry`, and the
generated gRPC modules as `duet.v1`. In a checkout each is a link to the folder of that name at
the repository root (pyproject.toml says why).
"""
