"""`InboxKVReceiver`: the receiver bookkeeping every backend shares.

A backend's own threads put what arrives into the inbox (`deliver`) or report that a request's
data can never arrive (`fail`); the engine thread's `poll` matches arrivals with what it
`expect`s, scatters arrived layers into their reserved blocks and acknowledges a request once
all of it is written. A request is complete when every shard it needs has arrived: each rank
of a tensor-parallel sender whose heads this receiver caches ships its part of them
(`layout.head_route`), under the same request id, and with pipeline stages each stage's
ranks their layers (`layout.layer_range`).
A backend may deliver a shard before its data has landed and report each piece (layers, or a
layer's blocks; kv_transfer/chunks.py) as it lands in a staging slot (`progress`); the engine
thread writes each piece once it is there and gives its slot back to the pool, so the copy into
the cache overlaps the rest of the transfer, and only an expected request's pieces are ever
written. A piece nobody expects holds its slot until the request is expected, dropped or stale.
A write that raises (out of memory) fails that request (retryable), never the worker.
A layer-wise sender's metadata (the first token) comes after its KV, as a trailer the
arrival fetches (`fetch_meta`); the request is complete once that is here too.

A transfer may carry the draft model's layers after the target's (`kv_transfer/layers.py`):
they are written into the draft blocks `expect` reserved, and the result says so (`draft`);
with no draft blocks reserved they are dropped.

Arrivals for a request nobody expects (yet) wait up to `stale_after_s` (the router may ask
the decode worker a moment after the prefill worker sent), then are dropped. Arrivals for an
aborted request are dropped on arrival and never written, so a retry must use a new request id
(the router numbers its attempts).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from duet.engine.kernels.cpu import load_cpu_kernels
from duet.kv_transfer.base import KVReceiver, TransferResult, TransferStatus
from duet.kv_transfer.chunks import Piece
from duet.kv_transfer.layers import PagedLayers, TransferShape, piece_cells
from duet.kv_transfer.layout import KVLayout, head_route, num_senders

logger = logging.getLogger(__name__)


@dataclass
class Expected:
    """A reservation: where a request's KV goes, and until when it may come."""

    block_ids: list[int]
    deadline: float
    draft_block_ids: list[int] | None = None  # the draft's blocks, when its KV is to come too


@dataclass
class Landed:
    """A piece of an arrival whose data is in a staging slot, not yet written."""

    piece: Piece
    data: torch.Tensor  # [end - start, 2, last - first, BS, h, D]
    release: Callable[[], None] | None = None  # gives the slot back (once written or dropped)


@dataclass
class Arrival:
    """One shard of one request's KV, arriving or arrived, and not yet all written."""

    shape: TransferShape  # the sender's staged layout: which layers and blocks, which heads
    layout: KVLayout  # the sender's
    meta: dict[str, Any] | None
    acknowledge: Callable[[], None]  # tells the sender its blocks landed
    time_s: float
    release: Callable[[], None] | None = None  # called once the inbox is done with the arrival
    fetch_meta: Callable[[], dict[str, Any] | None] | None = None
    """A trailer: `meta` is sent after the KV (layer-wise sending); returns it, or None while
    it has not come (never blocks)."""
    landed: list[Landed] = field(default_factory=list)  # under the inbox's lock
    num_written: int = 0  # (layer, block) cells written (or dropped) so far
    discarded: bool = False  # the inbox let go of it: a piece landing now is given back

    @property
    def written(self) -> bool:
        return self.num_written == self.shape.num_cells

    def complete(self) -> bool:
        """All written, and the metadata is here (fetched now if it is a trailer)."""
        if not self.written:
            return False
        if self.fetch_meta is not None:
            meta = self.fetch_meta()
            if meta is None:
                return False
            self.meta, self.fetch_meta = meta, None
        return True


class InboxKVReceiver(KVReceiver):
    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        layout: KVLayout,
        stale_after_s: float = 30.0,
        draft_caches: list[torch.Tensor] | None = None,
    ) -> None:
        """`draft_caches`: the draft model's, when `layout.draft` names it."""
        if (layout.draft is None) != (draft_caches is None):
            raise ValueError("draft_caches: given exactly when the layout names a draft")
        self.kv_caches = kv_caches
        self.draft_caches = draft_caches
        self.layout = layout
        self.stale_after_s = stale_after_s
        self._lock = threading.Lock()
        self._expected: dict[str, Expected] = {}
        self._inbox: dict[str, list[Arrival]] = {}
        self._failed: dict[str, tuple[str, float]] = {}  # id -> (why it can never arrive, when)
        self._aborted: dict[str, float] = {}  # request id -> when; late shards are dropped
        self._results: list[TransferResult] = []
        if kv_caches and kv_caches[0].device.type == "cpu":
            load_cpu_kernels()  # scatter's row copies: build now, not inside the first transfer

    # -- backend side (any thread) ---------------------------------------------------------

    def deliver(self, request_id: str, arrival: Arrival) -> None:
        with self._lock:
            if request_id in self._aborted:
                _discard([arrival])
            else:
                self._inbox.setdefault(request_id, []).append(arrival)

    def progress(
        self,
        arrival: Arrival,
        piece: Piece,
        data: torch.Tensor,
        release: Callable[[], None] | None = None,
    ) -> None:
        """A piece of a delivered arrival landed in `data` (a staging slot the inbox owns from
        now on: `release` gives it back once written, or at once if the arrival was dropped)."""
        with self._lock:
            if not arrival.discarded:
                arrival.landed.append(Landed(piece, data, release))
                arrival.time_s = time.monotonic()  # staleness counts from the latest data
                return
        if release is not None:
            release()

    def wrote(self, arrival: Arrival, piece: Piece) -> None:
        """A backend thread wrote a piece straight into the reserved blocks (call under the
        inbox's lock)."""
        arrival.num_written += piece_cells(piece)
        arrival.time_s = time.monotonic()

    def fail(self, request_id: str, why: str) -> None:
        with self._lock:
            self._failed[request_id] = (why, time.monotonic())

    def withdraw(self, request_id: str, layout: KVLayout) -> None:
        """The sender of these shards gave up on them (only the in-process backend can)."""
        with self._lock:
            arrivals = self._inbox.get(request_id, [])
            _discard([a for a in arrivals if a.layout == layout])
            arrivals[:] = [a for a in arrivals if a.layout != layout]

    # -- engine side -------------------------------------------------------------------------

    def expect(
        self,
        request_id: str,
        block_ids: list[int],
        timeout_s: float,
        draft_block_ids: list[int] | None = None,
    ) -> None:
        if draft_block_ids is not None and self.draft_caches is None:
            raise ValueError("draft_block_ids: this receiver has no draft caches")
        draft = list(draft_block_ids) if draft_block_ids is not None else None
        with self._lock:
            self._expected[request_id] = Expected(
                list(block_ids), time.monotonic() + timeout_s, draft
            )

    def poll(self) -> list[TransferResult]:
        now = time.monotonic()
        with self._lock:
            for request_id, expected in list(self._expected.items()):
                arrivals = self._inbox.get(request_id, [])
                try:
                    for arrival in arrivals:
                        self._write_ready(expected, arrival)
                except Exception as e:  # e.g. out of memory: that request fails, not the worker
                    logger.exception("writing the KV of %s failed", request_id)
                    _discard(self._inbox.pop(request_id))
                    arrivals = []
                    self._failed[request_id] = (f"writing its KV failed: {e}", now)
                if (
                    arrivals
                    and len(arrivals) >= self._num_shards(arrivals[0].layout)
                    and all(a.complete() for a in arrivals)
                ):
                    del self._inbox[request_id]
                    result = self._done(request_id, arrivals, expected)
                elif self._busy(request_id):
                    continue  # a backend thread is writing its blocks: it ends soon, either way
                elif request_id in self._failed:
                    why = self._failed.pop(request_id)[0]
                    result = TransferResult(request_id, TransferStatus.FAILED, why, retryable=True)
                elif now >= expected.deadline:
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
            self._drop_stale(now)
            out, self._results = self._results, []
        return out

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._expected.pop(request_id, None) is not None:
                self._results.append(TransferResult(request_id, TransferStatus.ABORTED))
            _discard(self._inbox.pop(request_id, []))
            self._aborted[request_id] = time.monotonic()  # shards may still be on the wire

    def _busy(self, request_id: str) -> bool:
        """A backend thread is writing straight into the request's reserved blocks (called
        under the lock): its outcome waits, so the blocks are never freed under the write."""
        return False

    def _num_shards(self, sender: KVLayout) -> int:
        return num_senders(sender, self.layout)

    def _write_ready(self, expected: Expected, arrival: Arrival) -> None:
        """Scatter the pieces that landed into the reserved blocks and give their slots back;
        draft pieces with no draft blocks reserved are dropped."""
        if not arrival.landed:
            return
        paged = self._paged(expected, arrival)
        while arrival.landed:
            landed = arrival.landed[0]
            if landed.piece[0] < paged.num_layers:
                paged.scatter_piece(landed.piece, landed.data)
            arrival.landed.pop(0)
            arrival.num_written += piece_cells(landed.piece)
            if landed.release is not None:
                landed.release()

    def _paged(self, expected: Expected, arrival: Arrival) -> PagedLayers:
        """Where the arrival's layers go: the reserved blocks, and the reserved draft blocks
        when both sides have the draft's layers."""
        device = self.kv_caches[0].device
        num_blocks = arrival.shape.num_blocks
        ids = torch.tensor(expected.block_ids[:num_blocks], dtype=torch.long, device=device)
        draft_ids = None
        if expected.draft_block_ids is not None and arrival.shape.num_draft:
            draft = expected.draft_block_ids[:num_blocks]
            draft_ids = torch.tensor(draft, dtype=torch.long, device=device)
        route = head_route(arrival.layout, self.layout)  # checked at the channel's handshake
        heads = route.dst_slice if route is not None else None
        return PagedLayers(
            self.stage_caches(arrival.layout), ids, self.draft_caches, draft_ids, heads
        )

    def stage_caches(self, sender: KVLayout) -> list[torch.Tensor]:
        """The caches of the layers `sender`'s transfers carry: every layer, or its pipeline
        stage's."""
        start, end = sender.layer_range
        return self.kv_caches[start:end]

    def _done(self, request_id: str, arrivals: list[Arrival], expected: Expected) -> TransferResult:
        for arrival in arrivals:
            arrival.acknowledge()
        _discard(arrivals)
        # Every shard carries the same metadata; the lowest rank's is the reference.
        first = min(arrivals, key=lambda a: a.layout.group_rank)
        draft = expected.draft_block_ids is not None and first.shape.num_draft > 0
        return TransferResult(request_id, TransferStatus.DONE, meta=first.meta, draft=draft)

    def _drop_stale(self, now: float) -> None:
        for request_id, arrivals in list(self._inbox.items()):
            if request_id not in self._expected and all(
                now - a.time_s > self.stale_after_s for a in arrivals
            ):
                _discard(self._inbox.pop(request_id))
        for request_id, since in list(self._aborted.items()):
            if now - since > self.stale_after_s:
                del self._aborted[request_id]
        for request_id, (_, since) in list(self._failed.items()):
            if request_id not in self._expected and now - since > self.stale_after_s:
                del self._failed[request_id]


def _discard(arrivals: list[Arrival]) -> None:
    """The inbox lets go of these arrivals and their slots (each leaves the inbox once; called
    under the inbox's lock)."""
    for arrival in arrivals:
        arrival.discarded = True
        for landed in arrival.landed:
            if landed.release is not None:
                landed.release()
        arrival.landed = []
        if arrival.release is not None:
            arrival.release()
