"""The `local` backend: sender and receiver in one process (aggregated mode, tests). Blocks
are copied through a `LocalHub` that both sides are given explicitly."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from duet.kv_transfer.base import KVSender, TransferResult, TransferStatus
from duet.kv_transfer.config import ReceiverConfig, SenderConfig
from duet.kv_transfer.inbox import Arrival, InboxKVReceiver, Landed
from duet.kv_transfer.layers import PagedLayers
from duet.kv_transfer.layout import KVLayout, checked_route
from duet.kv_transfer.outbox import Outbox


@dataclass
class LocalHub:
    """Mailboxes by receiver name. Thread-safe."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    receivers: dict[str, LocalKVReceiver] = field(default_factory=dict)


@dataclass(frozen=True)
class LocalSenderConfig(SenderConfig):
    hub: LocalHub | None = None
    """Where the receivers of this process are found (required)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hub is None:
            raise ValueError("hub: the local backend needs the LocalHub its receivers joined")


@dataclass(frozen=True)
class LocalReceiverConfig(ReceiverConfig):
    hub: LocalHub | None = None
    """The hub this receiver joins under its `name` (required)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hub is None:
            raise ValueError("hub: the local backend needs a LocalHub to join")


class LocalKVSender(KVSender):
    config_type: ClassVar[type[SenderConfig]] = LocalSenderConfig

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        layout: KVLayout,
        config: LocalSenderConfig,
        draft_caches: list[torch.Tensor] | None = None,
    ) -> None:
        assert config.hub is not None
        self.hub = config.hub
        self.kv_caches = kv_caches
        self.draft_caches = draft_caches
        self.layout = layout
        self.config = config
        self._outbox = Outbox(config.ack_timeout_s)

    def send(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        meta: dict[str, Any] | None = None,
        draft_block_ids: list[int] | None = None,
    ) -> None:
        with self.hub.lock:
            receiver = self.hub.receivers.get(dest)
        if receiver is None:
            self._outbox.report(
                TransferResult(
                    request_id, TransferStatus.FAILED, f"no receiver {dest!r}", retryable=True
                )
            )
            return
        heads = checked_route(self.layout, receiver.layout).src_slice
        paged = PagedLayers.of_ids(
            self.kv_caches, block_ids, self.draft_caches, draft_block_ids, heads
        )
        shape = paged.shape
        landed = []
        for start, end, _ in shape.groups():  # a copy of each group, whole
            piece = (start, end, 0, shape.num_blocks)
            first = self.kv_caches[0]
            data = torch.empty(shape.piece_shape(piece), dtype=first.dtype, device=first.device)
            paged.gather_piece(piece, data)
            landed.append(Landed(piece, data))
        self._outbox.open(request_id, dest, released=True, dest=dest)  # copied: blocks are free
        self._outbox.sent_chunk(request_id)  # all layers (the draft's too) in one copy
        arrival = Arrival(
            shape,
            self.layout,
            meta,
            lambda: self._outbox.acknowledge(request_id),  # the receiver wrote the blocks
            time.monotonic(),
            landed=landed,
        )
        receiver.deliver(request_id, arrival)

    def poll(self) -> list[TransferResult]:
        return self._outbox.poll()

    def abort(self, request_id: str) -> None:
        dest = self._outbox.channel_of(request_id)
        self._outbox.abort(request_id)
        if dest is not None:
            with self.hub.lock:
                receiver = self.hub.receivers.get(dest)
            if receiver is not None:
                receiver.withdraw(request_id, self.layout)


class LocalKVReceiver(InboxKVReceiver):
    config_type: ClassVar[type[ReceiverConfig]] = LocalReceiverConfig

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        layout: KVLayout,
        config: LocalReceiverConfig,
        draft_caches: list[torch.Tensor] | None = None,
    ) -> None:
        super().__init__(kv_caches, layout, draft_caches=draft_caches)
        assert config.hub is not None
        self.hub = config.hub
        self.name = config.name
        with self.hub.lock:
            self.hub.receivers[self.name] = self

    @property
    def address(self) -> str:
        """Senders find this receiver in the hub by its name."""
        return self.name

    def close(self) -> None:
        with self.hub.lock:
            if self.hub.receivers.get(self.name) is self:
                del self.hub.receivers[self.name]
