"""The `local` backend: sender and receiver in one process (aggregated mode, tests). Blocks
are copied through a `LocalHub` that both sides are given explicitly."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from kv_transfer.base import KVReceiver, KVSender, TransferResult, TransferStatus
from kv_transfer.blocks import gather_blocks, scatter_blocks
from kv_transfer.layout import KVLayout, check_compatible, receiver_head_slice


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
        self._results: list[TransferResult] = []
        self._pending: dict[str, str] = {}  # request id -> receiver name

    def send(self, request_id: str, block_ids: list[int], dest: str) -> None:
        with self.hub.lock:
            receiver = self.hub.receivers.get(dest)
        if receiver is None:
            self._results.append(
                TransferResult(
                    request_id, TransferStatus.FAILED, f"no receiver {dest!r}", retryable=True
                )
            )
            return
        check_compatible(self.layout, receiver.layout)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
        receiver.deliver(request_id, gather_blocks(self.kv_caches, ids), self.layout, self)
        self._pending[request_id] = dest

    def acknowledge(self, request_id: str, result: TransferResult) -> None:
        """Called by the receiver once it wrote (or refused) the blocks."""
        if self._pending.pop(request_id, None) is not None:
            self._results.append(result)

    def poll(self) -> list[TransferResult]:
        out, self._results = self._results, []
        return out

    def abort(self, request_id: str) -> None:
        dest = self._pending.pop(request_id, None)
        if dest is not None:
            with self.hub.lock:
                receiver = self.hub.receivers.get(dest)
            if receiver is not None:
                receiver.withdraw(request_id)
        self._results.append(TransferResult(request_id, TransferStatus.ABORTED))


class LocalKVReceiver(KVReceiver):
    def __init__(
        self, hub: LocalHub, name: str, kv_caches: list[torch.Tensor], layout: KVLayout
    ) -> None:
        self.hub = hub
        self.name = name
        self.kv_caches = kv_caches
        self.layout = layout
        self._lock = threading.Lock()
        self._expected: dict[str, tuple[list[int], float]] = {}  # id -> (blocks, deadline)
        self._inbox: dict[str, tuple[torch.Tensor, KVLayout, LocalKVSender]] = {}
        self._results: list[TransferResult] = []
        with hub.lock:
            hub.receivers[name] = self

    def expect(self, request_id: str, block_ids: list[int], timeout_s: float) -> None:
        with self._lock:
            self._expected[request_id] = (list(block_ids), time.monotonic() + timeout_s)

    def deliver(
        self, request_id: str, blocks: torch.Tensor, layout: KVLayout, sender: LocalKVSender
    ) -> None:
        with self._lock:
            self._inbox[request_id] = (blocks, layout, sender)

    def withdraw(self, request_id: str) -> None:
        with self._lock:
            self._inbox.pop(request_id, None)

    def poll(self) -> list[TransferResult]:
        now = time.monotonic()
        with self._lock:
            for request_id, (block_ids, deadline) in list(self._expected.items()):
                arrived = self._inbox.pop(request_id, None)
                if arrived is not None:
                    blocks, layout, sender = arrived
                    ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
                    heads = receiver_head_slice(layout, self.layout)
                    scatter_blocks(self.kv_caches, ids[: blocks.shape[2]], blocks, heads)
                    result = TransferResult(request_id, TransferStatus.DONE)
                    sender.acknowledge(request_id, result)
                elif now >= deadline:
                    result = TransferResult(
                        request_id,
                        TransferStatus.FAILED,
                        "timed out waiting for KV",
                        retryable=True,
                    )
                else:
                    continue
                del self._expected[request_id]
                self._results.append(result)
            out, self._results = self._results, []
        return out

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._expected.pop(request_id, None) is not None:
                self._results.append(TransferResult(request_id, TransferStatus.ABORTED))
            self._inbox.pop(request_id, None)

    def close(self) -> None:
        with self.hub.lock:
            if self.hub.receivers.get(self.name) is self:
                del self.hub.receivers[self.name]
