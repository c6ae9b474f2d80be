"""`PrefillWorkerConfig`: an engine configured for prefill, plus how its KV leaves."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.errors import InvalidInputError
from kv_transfer.factory import check_backend_name


@dataclass
class PrefillWorkerConfig(EngineConfig):
    kv_backend: str = "auto"
    """KV transfer backend: auto (tcp for CPU caches, torch_dist for GPU caches), tcp (CPU,
    straight between the caches), torch_dist (gloo or NCCL), or local (same process)."""
    kv_transfer_timeout_s: float = 30.0
    """Bound on one transfer's network operations (handshake, send)."""
    kv_lease_s: float = 60.0
    """How long sent blocks stay held waiting for the decode side's acknowledgement; must
    exceed `kv_transfer_timeout_s` and stay below the decode side's wait for KV."""
    kv_layerwise: bool = True
    """Send each layer's KV as soon as the forward pass wrote it, while later layers compute
    (backends that can: torch_dist, tcp); False sends whole requests after the pass."""

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            check_backend_name(self.kv_backend)
        except ValueError as e:
            raise InvalidInputError("kv_backend", str(e).removeprefix("kv_backend: ")) from None
        if self.kv_transfer_timeout_s <= 0:
            raise InvalidInputError(
                "kv_transfer_timeout_s", f"must be > 0; got {self.kv_transfer_timeout_s}"
            )
        if self.kv_lease_s <= self.kv_transfer_timeout_s:
            raise InvalidInputError(
                "kv_lease_s",
                f"must be > kv_transfer_timeout_s ({self.kv_transfer_timeout_s}); "
                f"got {self.kv_lease_s}",
            )
