"""The KV transfer interface, split by role as in vLLM's connector: the prefill side sends,
the decode side receives. Both are driven by their worker's engine thread; `poll` never blocks.

Ownership (see DESIGN.md, "Timeouts and ownership of KV blocks"): the sender keeps its blocks
until `poll` reports the transfer DONE (the receiver acknowledged) or FAILED/ABORTED; the
receiver owns the blocks it reserved from `expect` until its `poll` reports the outcome, and
frees them on failure or abort. After `abort`, no late write lands in the aborted blocks.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from kv_transfer.layout import KVLayout


class TransferStatus(enum.Enum):
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    status: TransferStatus
    error: str | None = None
    retryable: bool = False  # FAILED because of a timeout or a peer that went away
    meta: dict[str, Any] | None = None  # the sender's metadata, on the receiver's DONE


class KVSender(ABC):
    """Prefill side of a channel."""

    layout: KVLayout

    @abstractmethod
    def send(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Start shipping the request's blocks to receiver `dest`, with `meta` (small,
        JSON-serialisable: what the receiver needs besides the KV, e.g. the first token).
        Returns at once; the blocks may be reused once `poll` reports the transfer ended."""

    # Layer-wise sending (optional): `begin` before the forward pass that computes the
    # request's last prompt tokens, `layer_computed` after each of that pass's layers (its
    # blocks of that layer go out while later layers compute), `finish` with the metadata once
    # the first token is sampled. A backend that cannot returns False from `begin`, and the
    # caller uses `send` after the pass instead.

    def begin(self, request_id: str, block_ids: list[int], dest: str) -> bool:
        """Open a layer-wise transfer of `block_ids` to `dest`; False when this backend only
        sends whole requests. A failure to reach `dest` is reported by `poll`, like `send`'s."""
        return False

    def layer_computed(self, layer: int) -> None:  # noqa: B027 (optional hook)
        """Layer `layer` of the current forward pass wrote its KV: ship it for every transfer
        begun before the pass. Called on the thread running the pass, in layer order."""

    def finish(self, request_id: str, meta: dict[str, Any] | None = None) -> None:  # noqa: B027
        """The metadata of a transfer opened by `begin` (after its pass's last layer)."""

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Transfers that ended since the last call. Never blocks."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Give up on a transfer; it is reported ABORTED by the next `poll`."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release channels."""


class KVReceiver(ABC):
    """Decode side of a channel."""

    layout: KVLayout

    @abstractmethod
    def expect(self, request_id: str, block_ids: list[int], timeout_s: float) -> None:
        """Reserve: the request's KV will be written into `block_ids` (already allocated by the
        caller) when it arrives; a sender with larger tensor parallelism sends one shard per
        rank under the same id, and the transfer is DONE when all have landed. After
        `timeout_s` without it, the transfer FAILS (retryable)."""

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Transfers that ended since the last call: DONE means the blocks hold the KV. Never
        blocks."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop waiting; anything that arrives later for this request is dropped."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release channels."""
