"""The torch_dist backend's configs: the generic settings, and whether to emulate NCCL."""

from __future__ import annotations

from dataclasses import dataclass, field

from duet.kv_transfer.config import ReceiverConfig, SenderConfig
from duet.kv_transfer.torch_dist.nccl_emu import emulate_nccl_from_env


@dataclass(frozen=True)
class TorchDistSenderConfig(SenderConfig):
    """`timeout_s` bounds the store waits and each operation of a channel."""

    emulate_nccl: bool = field(default_factory=emulate_nccl_from_env)
    """CPU caches: NCCL's semantics over gloo (`nccl_emu.py`); both sides must agree. Default:
    the environment variable DUET_KV_EMULATE_NCCL=1."""


@dataclass(frozen=True)
class TorchDistReceiverConfig(ReceiverConfig):
    """Hosts the rendezvous `TCPStore` on `host:port`."""

    emulate_nccl: bool = field(default_factory=emulate_nccl_from_env)
    """As the sender's; a sender that differs is refused at the handshake."""
