"""The tcp backend's configs, and the caches it can move."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from duet.kv_transfer import sockio
from duet.kv_transfer.config import ReceiverConfig, SenderConfig
from duet.kv_transfer.tcp.stripes import MAX_STRIPES


@dataclass(frozen=True)
class TcpSenderConfig(SenderConfig):
    stripes: int = 2
    """Connections per receiver; a payload of at least `STRIPE_MIN_BYTES` per connection is
    split across them (`Stripes`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.stripes <= MAX_STRIPES:
            raise ValueError(f"stripes: must be in [1, {MAX_STRIPES}], got {self.stripes}")


@dataclass(frozen=True)
class TcpReceiverConfig(ReceiverConfig):
    """Listens on `host:port`; accepts as many stripes as a sender attaches (up to
    `MAX_STRIPES`)."""


def check_caches(kv_caches: list[torch.Tensor]) -> None:
    if not sockio.supported():
        raise ValueError("kv_backend 'tcp': needs Linux on a 64-bit machine; use torch_dist")
    if any(c.device.type != "cpu" or not c.is_contiguous() for c in kv_caches):
        raise ValueError(
            "kv_backend 'tcp': moves contiguous CPU caches only; use torch_dist (NCCL) for GPU caches"
        )
