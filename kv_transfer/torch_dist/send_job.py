"""`SendJob`: one transfer on the torch_dist sender's side, from `_open` until the send thread
has gathered its last piece: its pieces and tags, which pieces the forward pass computed, and
who still reads its blocks; `Posted`: a piece on its way out of its staging slot."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from duet.kv_transfer.chunks import Piece
from duet.kv_transfer.layers import PagedLayers
from duet.kv_transfer.outbox import Outbox
from duet.kv_transfer.torch_dist.channel import Channel
from duet.kv_transfer.torch_dist.link import LinkEvent


@dataclass
class SendJob:
    request_id: str
    channel: Channel
    layers: PagedLayers  # the target's blocks, and the draft's when it carries them
    pieces: list[Piece]  # the messages, in the transfer's order (kv_transfer/chunks.py)
    tags: list[int]
    meta: dict[str, Any] | None
    trailer: bool  # layer-wise: the metadata follows under a store key (`finish`)
    computed: list[threading.Event] = field(default_factory=list)  # per piece: in the cache
    ready: list[Any] = field(default_factory=list)  # per piece, CUDA: after the pass wrote it
    broken: bool = False  # the pass computing it never completed
    num_gathered: int = 0  # send thread: pieces gathered (and posted)
    num_sent: int = 0  # send thread: pieces whose send completed
    let_go: bool = False  # the send thread reads no more of its blocks
    last_gather: Any = None  # CUDA: an event after its latest gather on the copy stream
    error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.computed = [threading.Event() for _ in self.pieces]
        self.ready = [None] * len(self.pieces)

    def describe(self) -> dict[str, Any]:
        shape = self.layers.shape
        draft = [shape.num_draft, shape.draft_planes, shape.num_blocks, *shape.draft_row]
        return {
            "request_id": self.request_id,
            "shape": [shape.num_target, shape.planes, shape.num_blocks, *shape.row],
            "draft_shape": draft if shape.num_draft else None,
            "chunks": [[*p, t] for p, t in zip(self.pieces, self.tags, strict=True)],
            "meta": self.meta,
            "trailer": self.trailer,
        }

    def mark_computed(self, start: int, end: int) -> None:
        """Layers [start, end) are in the cache (the caller's thread, after writing them): the
        pieces they complete may be gathered. On CUDA an event on the caller's stream tells
        the send thread's copy stream when."""
        event = None
        for k, piece in enumerate(self.pieces):
            if start < piece[1] <= end:
                if event is None and self.layers.block_ids.is_cuda:
                    event = torch.cuda.Event()
                    event.record()
                self.ready[k] = event
                self.computed[k].set()

    def abandon(self) -> None:
        """The pass will never compute what is missing: the send thread stops waiting."""
        self.broken = True
        for computed in self.computed:
            computed.set()

    def release_blocks(self, outbox: Outbox) -> None:
        """The send thread gathered its last piece (or gave up on the rest): the blocks are
        the caller's again once the outcome is reported, and the lease starts."""
        if self.last_gather is not None:  # CUDA: the copy stream may still read the blocks
            self.last_gather.synchronize()  # a local copy: it never waits on the peer
        with self._lock:
            if self.let_go:
                return
            self.let_go = True
        outbox.release(self.request_id)

    def finished(self, outbox: Outbox) -> None:
        """`finish` (the metadata is out): restart the lease, unless the send thread still
        gathers (it releases the blocks when done; releasing now would let `poll` report a
        failure while it reads them)."""
        with self._lock:
            if self.let_go:
                outbox.release(self.request_id)


@dataclass
class Posted:
    """A piece whose send the send thread posted, from its staging slot."""

    job: SendJob
    data: torch.Tensor
    sent: LinkEvent  # completes once the send did (the slot may be reused then)
    done: bool = False  # the send thread saw `sent` complete
