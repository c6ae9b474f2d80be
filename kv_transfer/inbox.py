"""`InboxKVReceiver`: the receiver bookkeeping every backend shares.

A backend's own threads put what arrives into the inbox (`deliver`) or report that a request's
data can never arrive (`fail`); the engine thread's `poll` matches arrivals with what it
`expect`s, scatters arrived layers into their reserved blocks and acknowledges a request once
all of it is written. A request is complete when every shard it needs has arrived: a sender
with larger tensor parallelism ships one shard of heads per rank, under the same request id.
A backend may deliver a shard before its data has landed and report layers as they do
(`progress`); the engine thread writes each layer once it is ready, so the copy into the cache
overlaps the rest of the transfer, and only an expected request's layers are ever written.
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

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from duet.engine.kernels.cpu import load_cpu_kernels
from duet.kv_transfer.base import KVReceiver, TransferResult, TransferStatus
from duet.kv_transfer.layers import PagedLayers, staged_view
from duet.kv_transfer.layout import KVLayout, receiver_head_slice


@dataclass
class Expected:
    """A reservation: where a request's KV goes, and until when it may come."""

    block_ids: list[int]
    deadline: float
    draft_block_ids: list[int] | None = None  # the draft's blocks, when its KV is to come too


@dataclass
class Arrival:
    """One shard of one request's KV, arriving or arrived, and not yet all written."""

    blocks: torch.Tensor  # [L, 2, n, BS, h, D]; layers [0, layers_ready) hold data
    layout: KVLayout  # the sender's: which heads the shard holds
    meta: dict[str, Any] | None
    acknowledge: Callable[[], None]  # tells the sender its blocks landed
    time_s: float
    layers_ready: int = -1  # -1: all of them; raised by the backend through `progress`
    release: Callable[[], None] | None = None  # called once the inbox is done with `blocks`
    fetch_meta: Callable[[], dict[str, Any] | None] | None = None
    """A trailer: `meta` is sent after the KV (layer-wise sending); returns it, or None while
    it has not come (never blocks)."""
    layers_written: int = 0  # engine thread: written into the reserved blocks so far
    draft_blocks: torch.Tensor | None = None
    """[Ld, 2, n, BS, hd, Dd]: the draft's layers, transfer layers L.. (None: not carried)."""

    def __post_init__(self) -> None:
        if self.layers_ready < 0:
            self.layers_ready = self.num_layers

    @property
    def num_layers(self) -> int:
        """Transfer layers: the target's, then the draft's."""
        num_draft = self.draft_blocks.shape[0] if self.draft_blocks is not None else 0
        return self.blocks.shape[0] + num_draft

    def layers(self, start: int, end: int) -> torch.Tensor:
        """Transfer layers [start, end), within one group (`staged_view`)."""
        return staged_view(self.blocks, self.draft_blocks, start, end)

    @property
    def written(self) -> bool:
        return self.layers_written == self.num_layers

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

    def progress(self, arrival: Arrival, layers_ready: int) -> None:
        """Layers [0, layers_ready) of a delivered arrival's `blocks` hold their data."""
        with self._lock:
            arrival.layers_ready = layers_ready
            arrival.time_s = time.monotonic()  # staleness counts from the latest data

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
                for arrival in arrivals:
                    self._write_ready(expected, arrival)
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
        return max(1, self.layout.heads_per_rank // sender.heads_per_rank)

    def _write_ready(self, expected: Expected, arrival: Arrival) -> None:
        start, end = arrival.layers_written, arrival.layers_ready
        if start == end:
            return
        paged = self._paged(expected, arrival)
        # Draft layers with no draft blocks reserved (past `paged.num_layers`) are dropped.
        if start < paged.num_layers:
            heads = receiver_head_slice(arrival.layout, self.layout)
            paged.scatter(
                start, min(end, paged.num_layers), arrival.blocks, arrival.draft_blocks, heads
            )
        arrival.layers_written = end

    def _paged(self, expected: Expected, arrival: Arrival) -> PagedLayers:
        """Where the arrival's layers go: the reserved blocks, and the reserved draft blocks
        when both sides have the draft's layers."""
        device = self.kv_caches[0].device
        num_blocks = arrival.blocks.shape[2]
        ids = torch.tensor(expected.block_ids[:num_blocks], dtype=torch.long, device=device)
        draft_ids = None
        if expected.draft_block_ids is not None and arrival.draft_blocks is not None:
            draft = expected.draft_block_ids[:num_blocks]
            draft_ids = torch.tensor(draft, dtype=torch.long, device=device)
        return PagedLayers(self.kv_caches, ids, self.draft_caches, draft_ids)

    def _done(self, request_id: str, arrivals: list[Arrival], expected: Expected) -> TransferResult:
        for arrival in arrivals:
            arrival.acknowledge()
        _discard(arrivals)
        # Every shard carries the same metadata; the lowest rank's is the reference.
        first = min(arrivals, key=lambda a: a.layout.tp_rank)
        draft = expected.draft_block_ids is not None and first.draft_blocks is not None
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
    """The inbox lets go of these arrivals' buffers (each arrival leaves the inbox once)."""
    for arrival in arrivals:
        if arrival.release is not None:
            arrival.release()
