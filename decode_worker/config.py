"""`DecodeWorkerConfig`: an engine configured for decode, plus where its KV arrives."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.errors import InvalidInputError
from kv_transfer.factory import check_backend_name


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

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            check_backend_name(self.kv_backend)
        except ValueError as e:
            raise InvalidInputError("kv_backend", str(e).removeprefix("kv_backend: ")) from None
        for name in ("kv_transfer_timeout_s", "kv_wait_s"):
            if getattr(self, name) <= 0:
                raise InvalidInputError(name, f"must be > 0; got {getattr(self, name)}")
        if not 0 <= self.kv_port <= 65535:
            raise InvalidInputError("kv_port", f"must be in [0, 65535]; got {self.kv_port}")
