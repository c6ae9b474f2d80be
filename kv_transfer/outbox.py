"""`Outbox`: the sender bookkeeping every backend shares (the counterpart of `inbox.py`).

A transfer is open from `open` until `poll` reports its one outcome. Two things must both
happen before that report:

- an outcome is decided, and the first word stands: DONE when the receiver acknowledges
  (`acknowledge`), FAILED when the backend gives up (`fail`), ABORTED on `abort`; later words
  for the same transfer are ignored;
- the backend has let go of the blocks (`release`: no thread of it reads them any more), so
  the caller never frees blocks under a send.

The hold lease (docs/ARCHITECTURE.md, "KV block ownership") starts at `release`: a
transfer that is released but not acknowledged within `ack_timeout_s` is FAILED (retryable)
by `poll`, whatever the peer does. A transfer that never opened (its receiver unreachable:
`reach`) is reported as is (`report`).

Each outcome goes out with the chunks the backend sent (`sent_chunk`) and the rate of the link
to its receiver when a probe measured it (`set_link_gbps`, kv_transfer/link_probe.py); the
probe asks `activity` whether any transfer is open, and whether one opened while it ran.

Thread-safety: every method may be called from any thread; none blocks beyond a short lock.
The engine thread calls `poll`; backend threads decide outcomes and release blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from duet.kv_transfer.base import TransferResult, TransferStatus
from duet.kv_transfer.layout import HandshakeError

C = TypeVar("C")


@dataclass
class Outgoing:
    """The sender's record of one transfer until `poll` reports it."""

    channel: Any  # the backend's channel it goes over (None where there is none)
    dest: str = ""  # the receiver's address
    num_chunks: int = 0  # messages of whole layers sent so far
    outcome: TransferResult | None = None
    released: bool = False  # the backend no longer reads the blocks
    lease_deadline: float = float("inf")  # acknowledged by then, or FAILED


class Outbox:
    def __init__(self, ack_timeout_s: float) -> None:
        self.ack_timeout_s = ack_timeout_s
        self._lock = threading.Lock()
        self._transfers: dict[str, Outgoing] = {}
        self._results: list[TransferResult] = []
        self._num_opened = 0
        self._link_gbps: dict[str, float] = {}  # receiver address -> its link's probed rate

    # -- the sender's calls (any thread) ---------------------------------------------------------

    def open(
        self, request_id: str, channel: Any = None, released: bool = False, dest: str = ""
    ) -> None:
        """A transfer to receiver `dest` starts (`released`: the backend has copied the blocks
        already, and the lease starts now)."""
        with self._lock:
            self._transfers[request_id] = Outgoing(channel, dest)
            self._num_opened += 1
        if released:
            self.release(request_id)

    def sent_chunk(self, request_id: str) -> None:
        """One more message of whole layers of the transfer went out."""
        with self._lock:
            transfer = self._transfers.get(request_id)
            if transfer is not None:
                transfer.num_chunks += 1

    def set_link_gbps(self, dest: str, gbps: float) -> None:
        """The probed rate of the link to `dest`, reported with every later outcome for it."""
        with self._lock:
            self._link_gbps[dest] = gbps

    def release(self, request_id: str) -> None:
        """The backend no longer reads the transfer's blocks; the lease (re)starts now."""
        with self._lock:
            transfer = self._transfers.get(request_id)
            if transfer is not None:
                transfer.released = True
                transfer.lease_deadline = time.monotonic() + self.ack_timeout_s

    def release_channel(self, channel: Any) -> None:
        """Every transfer on `channel` is let go of (its thread ended) without starting a
        lease: their outcome is decided already."""
        with self._lock:
            for transfer in self._transfers.values():
                if transfer.channel is channel:
                    transfer.released = True

    def acknowledge(self, request_id: str) -> None:
        self.decide(request_id, TransferStatus.DONE)

    def fail(self, request_id: str, why: str) -> None:
        self.decide(request_id, TransferStatus.FAILED, why, retryable=True)

    def abort(self, request_id: str) -> None:
        self.decide(request_id, TransferStatus.ABORTED)

    def decide(
        self,
        request_id: str,
        status: TransferStatus,
        error: str | None = None,
        retryable: bool = False,
    ) -> None:
        """The transfer's outcome, unless it has one already (the first word stands); ignored
        for a transfer that is not open (reported already, or never opened)."""
        with self._lock:
            transfer = self._transfers.get(request_id)
            if transfer is not None and transfer.outcome is None:
                transfer.outcome = TransferResult(request_id, status, error, retryable)

    def report(self, result: TransferResult) -> None:
        """An outcome for a transfer that never opened: reported by the next `poll` as is."""
        with self._lock:
            self._results.append(result)

    def reach(self, request_id: str, dest: str, connect: Callable[[str], C]) -> C | None:
        """`connect(dest)`: the channel a new transfer goes over. None when the receiver cannot
        be reached: the transfer is then reported FAILED, retryable (the router retries
        elsewhere). A HandshakeError (the receiver refused the handshake) propagates."""
        try:
            return connect(dest)
        except HandshakeError:
            raise
        except Exception as e:  # receiver unreachable
            self.report(
                TransferResult(request_id, TransferStatus.FAILED, f"{dest}: {e}", retryable=True)
            )
            return None

    # -- questions (any thread) ------------------------------------------------------------------

    def decided(self, request_id: str) -> bool:
        """The transfer has an outcome (or is not open): nothing more of it should be sent."""
        with self._lock:
            transfer = self._transfers.get(request_id)
            return transfer is None or transfer.outcome is not None

    def undecided(self, channel: Any = None) -> list[str]:
        """Open transfers without an outcome yet (on `channel`, when given)."""
        with self._lock:
            return [
                request_id
                for request_id, t in self._transfers.items()
                if t.outcome is None and (channel is None or t.channel is channel)
            ]

    def channels(self) -> list[Any]:
        """The channels open transfers go over, each once."""
        with self._lock:
            found = {id(t.channel): t.channel for t in self._transfers.values()}
        return list(found.values())

    def channel_of(self, request_id: str) -> Any:
        with self._lock:
            transfer = self._transfers.get(request_id)
            return None if transfer is None else transfer.channel

    def link_gbps(self, dest: str) -> float | None:
        with self._lock:
            return self._link_gbps.get(dest)

    def activity(self) -> tuple[int, int]:
        """(transfers open now, transfers opened since this outbox was made)."""
        with self._lock:
            return len(self._transfers), self._num_opened

    # -- the engine thread -----------------------------------------------------------------------

    def poll(self) -> list[TransferResult]:
        """Outcomes to report: decided and released transfers, and leases that expired.
        Never blocks."""
        now = time.monotonic()
        with self._lock:
            for request_id, transfer in list(self._transfers.items()):
                if (
                    transfer.outcome is None
                    and transfer.released
                    and now >= transfer.lease_deadline
                ):
                    transfer.outcome = TransferResult(
                        request_id, TransferStatus.FAILED, "no acknowledgement", retryable=True
                    )
                if transfer.outcome is not None and transfer.released:
                    self._results.append(
                        replace(
                            transfer.outcome,
                            num_chunks=transfer.num_chunks,
                            link_gbps=self._link_gbps.get(transfer.dest),
                        )
                    )
                    del self._transfers[request_id]
            out, self._results = self._results, []
        return out
