"""`DecodeWorkerConfig`: an engine configured for decode, plus where its KV arrives."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.errors import InvalidInputError
from kv_transfer.factory import check_backend_name
from kv_transfer.staging import transfer_reservations


@dataclass
class DecodeWorkerConfig(EngineConfig):
    kv_backend: str = "auto"
    """KV transfer backend: auto (tcp for CPU caches, torch_dist for GPU caches), tcp (CPU,
    straight between the caches), torch_dist (gloo or NCCL), or local (same process)."""
    kv_host: str = "127.0.0.1"
    """Address the KV receiver listens on."""
    kv_port: int = 0
    """Port of the KV receiver; 0 picks a free one."""
    kv_advertise_host: str | None = None
    """Host prefill workers dial (default `kv_host`; set it when listening on 0.0.0.0)."""
    kv_transfer_timeout_s: float = 30.0
    """Bound on one transfer's network operations; also how long unclaimed KV is kept."""
    kv_wait_s: float = 90.0
    """Default wait for a reserved request's KV; must exceed the prefill side's lease."""

    kv_staged_requests: int = 2
    """On a GPU with the pool sized from free memory: whole `max_model_len`-token requests
    whose KV transfer staging buffers the pool leaves room for (the staging pool keeps two
    idle buffers; more concurrent long transfers need more)."""
    kv_nccl_peers: int = 4
    """On a GPU with the pool sized from free memory: NCCL communicators (one per peer
    worker a torch_dist channel joins) the pool leaves room for."""

    def device_reservations(self, block_bytes: int, max_model_len: int) -> dict[str, int]:
        return transfer_reservations(
            self.kv_backend, block_bytes, self.block_size, max_model_len,
            self.kv_staged_requests, self.kv_nccl_peers,
        )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("kv_staged_requests", "kv_nccl_peers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidInputError(name, f"must be an integer >= 0; got {value!r}")
        try:
            check_backend_name(self.kv_backend)
        except ValueError as e:
            raise InvalidInputError("kv_backend", str(e).removeprefix("kv_backend: ")) from None
        for name in ("kv_transfer_timeout_s", "kv_wait_s"):
            if getattr(self, name) <= 0:
                raise InvalidInputError(name, f"must be > 0; got {getattr(self, name)}")
        if not 0 <= self.kv_port <= 65535:
            raise InvalidInputError("kv_port", f"must be in [0, 65535]; got {self.kv_port}")
