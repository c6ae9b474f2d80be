"""The `local` backend: sender and receiver in one process (aggregated mode, tests). Blocks
are copied through a `LocalHub` that both sides are given explicitly."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_transfer.base import KVSender, TransferResult, TransferStatus
from kv_transfer.blocks import gather_blocks
from kv_transfer.inbox import Arrival, InboxKVReceiver
from kv_transfer.layout import KVLayout, check_compatible


@dataclass
class LocalHub:
    """Mailboxes by receiver name. Thread-safe."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    receivers: dict[str, LocalKVReceiver] = field(default_factory=dict)


class LocalKVSender(KVSender):
    def __init__(self, hub: LocalHub, kv_caches: list[torch.Tensor], layout: KVLayout) -> None:
        self.hub = hub
        self.kv_caches = kv_caches
        self.layout = layout
        self._lock = threading.Lock()
        self._results: list[TransferResult] = []
        self._pending: dict[str, str] = {}  # request id -> receiver name

    def send(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        meta: dict[str, Any] | None = None,
    ) -> None:
        with self.hub.lock:
            receiver = self.hub.receivers.get(dest)
        if receiver is None:
            self._report(
                TransferResult(
                    request_id, TransferStatus.FAILED, f"no receiver {dest!r}", retryable=True
                )
            )
            return
        check_compatible(self.layout, receiver.layout)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
        with self._lock:
            self._pending[request_id] = dest
        receiver.deliver(
            request_id,
            Arrival(
                gather_blocks(self.kv_caches, ids),
                self.layout,
                meta,
                lambda: self._acknowledge(request_id),
                time.monotonic(),
            ),
        )

    def _acknowledge(self, request_id: str) -> None:
        """Called by the receiver once it wrote the blocks."""
        with self._lock:
            if self._pending.pop(request_id, None) is None:
                return
        self._report(TransferResult(request_id, TransferStatus.DONE))

    def _report(self, result: TransferResult) -> None:
        with self._lock:
            self._results.append(result)

    def poll(self) -> list[TransferResult]:
        with self._lock:
            out, self._results = self._results, []
        return out

    def abort(self, request_id: str) -> None:
        with self._lock:
            dest = self._pending.pop(request_id, None)
        if dest is not None:
            with self.hub.lock:
                receiver = self.hub.receivers.get(dest)
            if receiver is not None:
                receiver.withdraw(request_id, self.layout)
        self._report(TransferResult(request_id, TransferStatus.ABORTED))


class LocalKVReceiver(InboxKVReceiver):
    def __init__(
        self, hub: LocalHub, name: str, kv_caches: list[torch.Tensor], layout: KVLayout
    ) -> None:
        super().__init__(kv_caches, layout)
        self.hub = hub
        self.name = name
        with hub.lock:
            hub.receivers[name] = self

    def close(self) -> None:
        with self.hub.lock:
            if self.hub.receivers.get(self.name) is self:
                del self.hub.receivers[self.name]
