"""`DecodeWorkerConfig`: an engine configured for decode, plus where its KV arrives."""

from __future__ import annotations

from dataclasses import dataclass

from duet.engine.errors import InvalidInputError
from duet.kv_transfer.worker_config import KVWorkerConfig


@dataclass
class DecodeWorkerConfig(KVWorkerConfig):
    kv_host: str = "127.0.0.1"
    """Address the KV receiver listens on."""
    kv_port: int = 0
    """Port of the KV receiver; 0 picks a free one."""
    kv_advertise_host: str | None = None
    """Host prefill workers dial (default `kv_host`; set it when listening on 0.0.0.0)."""
    kv_wait_s: float = 90.0
    """Default wait for a reserved request's KV; must exceed the prefill side's lease."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pipeline_parallel_size != 1:
            # NOTE: a receiver caches every layer; a staged decode worker would need one per
            # stage, each taking its layers (the layout handshake refuses a staged receiver)
            raise InvalidInputError(
                "pipeline_parallel_size",
                "decode workers run one pipeline stage (prefill groups and aggregated engines "
                f"take more); got {self.pipeline_parallel_size}",
            )
        spec = self.speculative()
        if spec is not None and spec.drafts_on_prefill and self.tensor_parallel_size != 1:
            # NOTE: the draft's KV lands whole (it is never sharded): one rank to land on
            raise InvalidInputError(
                "speculative_config",
                f"'draft_prefill' {spec.draft_prefill_mode!r} sends the draft's prompt KV to "
                "decode workers, which must then run without tensor parallelism "
                f"(tensor_parallel_size 1); got {self.tensor_parallel_size} (use draft_prefill "
                "decode)",
            )
        if self.kv_wait_s <= 0:
            raise InvalidInputError("kv_wait_s", f"must be > 0; got {self.kv_wait_s}")
        if not 0 <= self.kv_port <= 65535:
            raise InvalidInputError("kv_port", f"must be in [0, 65535]; got {self.kv_port}")
