"""The KV transfer interface: the prefill side sends (`KVSender`), the decode side receives
(`KVReceiver`). As in vLLM v1's connector, each side's calls split by role:

- scheduler-side calls decide what to hold, reserve and release: the receiver's `expect`
  (reserve: the caller allocated the blocks) and `abort` (release), and the outcome a
  `poll` reports on either side (DONE, FAILED, ABORTED: when the caller may free or reuse the
  blocks);
- worker-side calls move the bytes: the sender's `send`, or `begin` / `layer_computed` /
  `finish` around the forward pass that computes the KV, and its `abort`.

In duet both roles run on the worker's engine thread (the scheduler and the model runner share
it), so neither interface is thread-safe for its caller: one thread calls every method of an
object, and `layer_computed` comes from the thread running the pass (that same thread).
Backends run their own threads for I/O; they hand results to `poll` through locked queues.

Invariants:
- `poll` never blocks, on either side, whatever the peer does (a silent or stopped peer
  included): no network round trip, no wait on a backend thread. It may copy bytes that have
  landed into the reserved blocks, and write a small acknowledgement into a socket's buffer.
- Every transfer the sender opened is reported exactly once by the sender's `poll`; every
  `expect` exactly once by the receiver's `poll`.
- Ownership (docs/ARCHITECTURE.md, "KV block ownership"): the sender keeps its blocks
  until `poll` reports the transfer DONE (the receiver acknowledged) or FAILED/ABORTED, and no
  backend thread reads them after that report; the receiver owns the blocks it reserved from
  `expect` until its `poll` reports the outcome, and frees them on failure or abort. After the
  receiver's `abort` returns, no late write lands in the aborted blocks.
- Bounds nest: a sender reports FAILED (retryable) when no acknowledgement came within its
  `ack_timeout_s` lease; a receiver FAILS a request at its `expect` deadline.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from duet.kv_transfer.config import ReceiverConfig, SenderConfig
from duet.kv_transfer.layout import KVLayout


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
    num_chunks: int = 0  # the sender's: messages of whole layers it sent (kv_transfer/chunks.py)
    link_gbps: float | None = None  # the sender's: its link to the receiver, as probed; None: not
    draft: bool = False  # receiver's DONE: the draft's KV landed in its reserved draft blocks


class KVSender(ABC):
    """Prefill side of a channel. Built by `create_sender` as `cls(kv_caches, layout, config,
    draft_caches)` with a `config_type` config (`draft_caches` when `layout.draft` names a
    draft model, else None)."""

    config_type: ClassVar[type[SenderConfig]] = SenderConfig
    layout: KVLayout

    # -- worker side ---------------------------------------------------------------------------

    @abstractmethod
    def send(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        meta: dict[str, Any] | None = None,
        draft_block_ids: list[int] | None = None,
    ) -> None:
        """Start shipping the request's blocks to receiver `dest`, with `meta` (small,
        JSON-serialisable: what the receiver needs besides the KV, e.g. the first token).
        Returns without waiting for the transfer (opening a new channel to `dest` may wait up to
        the sender's `timeout_s`); the blocks may be reused once `poll` reports it ended.
        `draft_block_ids` (a sender built with draft caches): the draft's blocks holding its KV
        over the same tokens, one per entry of `block_ids`, shipped after the target's layers
        (`kv_transfer/layers.py`) and held like them."""

    # Layer-wise sending (optional): `begin` before the forward pass that computes the
    # request's last prompt tokens, `layer_computed` after each of that pass's layers (its
    # blocks of that layer go out while later layers compute), `finish` with the metadata once
    # the first token is sampled. A backend that cannot returns False from `begin`, and the
    # caller uses `send` after the pass instead.

    def begin(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        draft_block_ids: list[int] | None = None,
    ) -> bool:
        """Open a layer-wise transfer of `block_ids` to `dest`; False when this backend only
        sends whole requests. A failure to reach `dest` is reported by `poll`, like `send`'s.
        `draft_block_ids`: as `send`'s; the draft's KV is in them already (it goes out after
        the target's layers, which `layer_computed` reports)."""
        return False

    def layer_computed(self, layer: int) -> None:  # noqa: B027 (optional hook)
        """Layer `layer` of the current forward pass wrote its KV: ship it for every transfer
        begun before the pass. Called on the thread running the pass, in layer order."""

    def finish(self, request_id: str, meta: dict[str, Any] | None = None) -> None:  # noqa: B027
        """The metadata of a transfer opened by `begin` (after its pass's last layer)."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Give up on a transfer; it is reported ABORTED by a later `poll` (once no backend
        thread reads its blocks), unless it had ended already."""

    # -- scheduler side ------------------------------------------------------------------------

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Transfers that ended since the last call; the caller may free or reuse their blocks.
        Never blocks."""

    def link_gbps(self, dest: str) -> float | None:
        """The rate of the link to receiver `dest` in GB/s, as this sender's probe measured it
        (kv_transfer/link_probe.py); None until measured, or when this backend does not probe.
        Never blocks."""
        return None

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release channels and stop the backend's threads."""


class KVReceiver(ABC):
    """Decode side of a channel. Built by `create_receiver` as `cls(kv_caches, layout,
    config, draft_caches)` with a `config_type` config."""

    config_type: ClassVar[type[ReceiverConfig]] = ReceiverConfig
    layout: KVLayout

    @property
    @abstractmethod
    def address(self) -> str:
        """What a sender passes as `dest` to reach this receiver (`host:port` for the network
        backends, the receiver's name for `local`)."""

    # -- scheduler side ------------------------------------------------------------------------

    @abstractmethod
    def expect(
        self,
        request_id: str,
        block_ids: list[int],
        timeout_s: float,
        draft_block_ids: list[int] | None = None,
    ) -> None:
        """Reserve: the request's KV will be written into `block_ids` (already allocated by the
        caller) when it arrives; each rank of a tensor-parallel sender that holds some of this
        receiver's heads sends them under the same id (`layout.head_route`), and the
        transfer is DONE when all have landed. After
        `timeout_s` without it, the transfer FAILS (retryable). `draft_block_ids` (a receiver
        built with draft caches): where the draft's KV goes if the transfer carries it (DONE
        then says `draft`); the caller owns them as it owns `block_ids`."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Release: stop waiting; anything that arrives later for this request is dropped.
        Once it returns, no backend thread writes the request's blocks."""

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Transfers that ended since the last call: DONE means the blocks hold the KV; on
        FAILED or ABORTED the caller frees them. Never blocks."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release channels and stop the backend's threads."""
