"""The nixl backend's configs, and the caches it can move."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from duet.kv_transfer.config import ReceiverConfig, SenderConfig

MODES = ("pull", "push")
ENV_MODE = "DUET_KV_NIXL_MODE"


def mode_from_env() -> str:
    """`DUET_KV_NIXL_MODE` (pull or push; unset: pull), so that `duet serve --kv-backend nixl`
    can run either without a flag of its own; any other value is an error naming it."""
    value = os.environ.get(ENV_MODE, "pull")
    if value not in MODES:
        raise ValueError(f"{ENV_MODE}: must be one of {', '.join(MODES)}; got {value!r}")
    return value


@dataclass(frozen=True)
class NixlSenderConfig(SenderConfig):
    """`timeout_s` bounds the join, each transfer's window on the blocks (see the package's
    docstring) and the liveness pings; `ack_timeout_s` the wait for the receiver's word."""

    mode: str = field(default_factory=mode_from_env)
    """pull (default): the decode side reads this side's blocks once it has reserved its own,
    then says so and they are released; push: this side writes into the blocks the decode side
    names. Chosen per sender; a receiver serves both."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in MODES:
            raise ValueError(f"mode: must be one of {', '.join(MODES)}; got {self.mode!r}")


@dataclass(frozen=True)
class NixlReceiverConfig(ReceiverConfig):
    """Serves the membership service (`Join`, `Leave`, `Ping`) on `host:port`; KV moves agent
    to agent."""


def check_caches(kv_caches: list[torch.Tensor]) -> None:
    """Each cache tensor is registered whole, once: it must be contiguous, on one device type."""
    if any(not c.is_contiguous() for c in kv_caches):
        raise ValueError("kv_backend 'nixl': registers contiguous caches only")
    if len({c.device.type for c in kv_caches}) != 1:
        raise ValueError("kv_backend 'nixl': every cache on one kind of device (CPU or CUDA)")
