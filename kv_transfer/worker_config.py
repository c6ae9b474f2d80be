"""`KVWorkerConfig`: what a prefill and a decode worker share about moving KV, on top of the
engine's configuration: the backend, the bound on a transfer, the staging pool, and what a GPU
pool sized from free memory leaves room for (the staging pool, NCCL communicators)."""

from __future__ import annotations

from dataclasses import dataclass

from duet.engine.config import EngineConfig
from duet.engine.errors import InvalidInputError
from duet.kv_transfer.factory import check_backend_name
from duet.kv_transfer.staging import (
    DEFAULT_STAGING_BYTES,
    check_staging_bytes,
    transfer_reservations,
)


@dataclass
class KVWorkerConfig(EngineConfig):
    kv_backend: str = "auto"
    """KV transfer backend: auto (tcp for CPU caches, torch_dist for GPU caches), tcp (CPU,
    straight between the caches), torch_dist (gloo or NCCL), nixl (cache to cache over UCX,
    CPU or GPU), or local (same process)."""
    kv_transfer_timeout_s: float = 30.0
    """Bound on one transfer's network operations (handshake, send, receive); on a decode
    worker also how long unclaimed KV is kept."""
    kv_staging_bytes: int = DEFAULT_STAGING_BYTES
    """The staging pool torch_dist and tcp transfers stream through, in bytes (one per worker
    or TP rank; kv_transfer/staging.py): a transfer of any length uses at most this much and
    waits for room beyond it. On a GPU the KV pool sized from free memory leaves room for it."""
    kv_nccl_peers: int = 4
    """On a GPU with the pool sized from free memory: NCCL communicators (one per peer
    worker a torch_dist channel joins) the pool leaves room for."""

    def device_reservations(self, block_bytes: int, max_model_len: int) -> dict[str, int]:
        return transfer_reservations(self.kv_backend, self.kv_staging_bytes, self.kv_nccl_peers)

    def __post_init__(self) -> None:
        super().__post_init__()
        value = self.kv_nccl_peers
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidInputError("kv_nccl_peers", f"must be an integer >= 0; got {value!r}")
        try:
            check_staging_bytes("kv_staging_bytes", self.kv_staging_bytes)
        except ValueError as e:
            raise InvalidInputError(
                "kv_staging_bytes", str(e).removeprefix("kv_staging_bytes: ")
            ) from None
        try:
            check_backend_name(self.kv_backend)
        except ValueError as e:
            raise InvalidInputError("kv_backend", str(e).removeprefix("kv_backend: ")) from None
        if self.kv_transfer_timeout_s <= 0:
            raise InvalidInputError(
                "kv_transfer_timeout_s", f"must be > 0; got {self.kv_transfer_timeout_s}"
            )
