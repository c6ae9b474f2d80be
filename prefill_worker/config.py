"""`PrefillWorkerConfig`: an engine configured for prefill, plus how its KV leaves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from duet.engine.errors import InvalidInputError
from duet.kv_transfer.worker_config import KVWorkerConfig


@dataclass
class PrefillWorkerConfig(KVWorkerConfig):
    decodes: ClassVar[bool] = False
    """A prefill worker runs no decode step (its requests end at their first token), so it
    captures no decode graphs and reserves no memory for them; with `cuda_graph_mode`
    piecewise (and not `enforce_eager`) its prompt chunks of up to 512 tokens run in pieces."""
    kv_lease_s: float = 60.0
    """How long sent blocks stay held waiting for the decode side's acknowledgement; must
    exceed `kv_transfer_timeout_s` and stay below the decode side's wait for KV."""
    kv_layerwise: bool = True
    """Send each layer's KV as soon as the forward pass wrote it, while later layers compute
    (backends that can: torch_dist, tcp); False sends whole requests after the pass."""

    def __post_init__(self) -> None:
        super().__post_init__()
        spec = self.speculative()
        if spec is not None and spec.drafts_on_prefill and self.num_ranks != 1:
            raise InvalidInputError(
                "speculative_config",
                f"'draft_prefill' {spec.draft_prefill_mode!r} prefills the draft on prefill "
                "workers, which must then run on one rank (tensor_parallel_size and "
                f"pipeline_parallel_size 1); got {self.tensor_parallel_size} x "
                f"{self.pipeline_parallel_size} (use draft_prefill decode)",
            )
        if self.kv_lease_s <= self.kv_transfer_timeout_s:
            raise InvalidInputError(
                "kv_lease_s",
                f"must be > kv_transfer_timeout_s ({self.kv_transfer_timeout_s}); "
                f"got {self.kv_lease_s}",
            )
