"""`SendJob`: one transfer on the torch_dist sender's side, from `_open` until its last chunk's
send completed: its staging buffer, its chunks and tags, and which chunks are gathered."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from duet.kv_transfer.layers import PagedLayers, staged_view
from duet.kv_transfer.torch_dist.channel import Channel
from duet.kv_transfer.torch_dist.link import LinkEvent


@dataclass
class SendJob:
    request_id: str
    channel: Channel
    layers: PagedLayers  # the target's blocks, and the draft's when it carries them
    blocks: torch.Tensor  # [L, 2, n, BS, h, D], a staging buffer being filled
    draft_blocks: torch.Tensor | None  # [Ld, 2, n, BS, hd, Dd], in the same buffer
    chunks: list[tuple[int, int]]  # [start, end) layers per message (within one group)
    tags: list[int]
    meta: dict[str, Any] | None
    trailer: bool  # layer-wise: the metadata follows under a store key (`finish`)
    gathered: list[threading.Event] = field(default_factory=list)  # per chunk: in `blocks`
    events: list[Any] = field(default_factory=list)  # per chunk: its CUDA event, on CUDA
    gather_failed: bool = False
    sent: LinkEvent | None = None  # recorded after its last chunk was posted
    done: bool = False  # the send thread saw `sent` complete
    error: str | None = None

    def __post_init__(self) -> None:
        self.gathered = [threading.Event() for _ in self.chunks]
        self.events = [None] * len(self.chunks)

    def describe(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "shape": list(self.blocks.shape),
            "draft_shape": list(self.draft_blocks.shape) if self.draft_blocks is not None else None,
            "chunks": [[s, e, t] for (s, e), t in zip(self.chunks, self.tags, strict=True)],
            "meta": self.meta,
            "trailer": self.trailer,
        }

    def chunk(self, k: int) -> torch.Tensor:
        """Chunk k's staged layers."""
        start, end = self.chunks[k]
        return staged_view(self.blocks, self.draft_blocks, start, end)

    def gather(self, start: int, end: int) -> None:
        """Gather layers [start, end) (the caller's thread); mark the chunks they complete."""
        try:
            self.layers.gather(start, end, self.blocks, self.draft_blocks)
        except BaseException:
            self.fail_gather()
            raise
        for k, (_, chunk_end) in enumerate(self.chunks):
            if start < chunk_end <= end:
                if self.blocks.is_cuda:
                    self.events[k] = torch.cuda.Event()
                    self.events[k].record()
                self.gathered[k].set()

    def fail_gather(self) -> None:
        self.gather_failed = True
        for gathered in self.gathered:
            gathered.set()

    def wait_gathered(self, timeout_s: float) -> bool:
        return all(e.wait(timeout_s) for e in self.gathered) and not self.gather_failed
