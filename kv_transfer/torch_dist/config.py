"""The torch_dist backend's configs: the generic settings, nothing of its own."""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.config import ReceiverConfig, SenderConfig


@dataclass(frozen=True)
class TorchDistSenderConfig(SenderConfig):
    """`timeout_s` bounds the store waits and the group's operations."""


@dataclass(frozen=True)
class TorchDistReceiverConfig(ReceiverConfig):
    """Hosts the rendezvous `TCPStore` on `host:port`."""
