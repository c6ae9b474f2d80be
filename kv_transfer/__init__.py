"""Moving paged KV blocks between workers: layouts and handshakes, block gather/scatter, and
sender/receiver backends registered by name (`tcp`, `torch_dist`, `local`), each built from
the generic `SenderConfig` / `ReceiverConfig` plus its own options (see docs/kv_transfer.md)."""

from duet.kv_transfer.base import KVReceiver, KVSender, TransferResult, TransferStatus
from duet.kv_transfer.blocks import gather_blocks, scatter_blocks
from duet.kv_transfer.config import ReceiverConfig, SenderConfig
from duet.kv_transfer.factory import (
    available_backends,
    create_receiver,
    create_sender,
    register_backend,
)
from duet.kv_transfer.layout import HandshakeError, KVLayout, check_compatible

__all__ = [
    "HandshakeError",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "ReceiverConfig",
    "SenderConfig",
    "TransferResult",
    "TransferStatus",
    "available_backends",
    "check_compatible",
    "create_receiver",
    "create_sender",
    "gather_blocks",
    "register_backend",
    "scatter_blocks",
]
