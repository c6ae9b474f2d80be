"""The layers one transfer carries: the target model's and, on a channel whose layouts name a
draft model (`KVLayout.draft`), optionally the draft's after them, over the same number of
blocks but at the draft pool's own block ids, with its own heads and head size.

Transfer layer i < num_target is target layer i; layer num_target + j is draft layer j. The
layers of one group share a shape, so a transfer is cut into chunks that never span both
(`layer_groups`, `transfer_chunks`) and each chunk moves as target layers always did: as rows
of the paged caches (`PagedLayers`: the tcp backend's vectored I/O, gather and scatter), or as
a slice of one staging tensor per group (`staged_view`: [L, 2, n, BS, h, D] for the target,
[Ld, 2, n, BS, hd, Dd] for the draft).

The draft's KV must be in its caches before the transfer opens (`send` or `begin`): the
prefill worker computes the draft over the prompt first, so its chunks are ready at once while
the target's last pass is still writing its layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from duet.kv_transfer import sockio
from duet.kv_transfer.blocks import gather_blocks, scatter_blocks
from duet.kv_transfer.chunks import layer_chunks


def layer_groups(num_target: int, num_draft: int) -> list[tuple[int, int]]:
    """[start, end) transfer layers of each group: the target's, then the draft's if any."""
    return [(0, num_target)] + ([(num_target, num_target + num_draft)] if num_draft else [])


def transfer_chunks(
    num_target: int,
    target_layer_bytes: int,
    num_draft: int = 0,
    draft_layer_bytes: int = 0,
    whole: bool = False,
) -> list[tuple[int, int]]:
    """[start, end) layer ranges of a transfer's messages: `layer_chunks` within each group
    (or, `whole`, one message per group)."""
    out = []
    for (start, end), nbytes in zip(
        layer_groups(num_target, num_draft), (target_layer_bytes, draft_layer_bytes), strict=False
    ):
        ranges = [(0, end - start)] if whole else layer_chunks(end - start, nbytes)
        out += [(start + s, start + e) for s, e in ranges]
    return out


def staged_view(
    blocks: torch.Tensor, draft_blocks: torch.Tensor | None, start: int, end: int
) -> torch.Tensor:
    """Transfer layers [start, end) of a staged transfer (target `blocks` [L, ...], then
    `draft_blocks` [Ld, ...]), as one tensor: the range must lie within one group."""
    num_target = blocks.shape[0]
    if end <= num_target:
        return blocks[start:end]
    if draft_blocks is None or start < num_target or end > num_target + draft_blocks.shape[0]:
        raise ValueError(f"layers [{start}, {end}): not within one group of the transfer")
    return draft_blocks[start - num_target : end - num_target]


@dataclass(frozen=True)
class PagedLayers:
    """A transfer's layers in one side's paged caches (per layer [2, NB, BS, h, D]): the
    target's `caches` at `block_ids`, then, when `draft_block_ids` is given, `draft_caches` at
    those. Both lists of ids have one entry per transferred block, in prompt order."""

    caches: list[torch.Tensor]
    block_ids: torch.Tensor  # [n] long, on the caches' device
    draft_caches: list[torch.Tensor] | None = None
    draft_block_ids: torch.Tensor | None = None  # [n] long

    def __post_init__(self) -> None:
        if self.draft_block_ids is not None:
            if not self.draft_caches:
                raise ValueError("draft_block_ids: this side has no draft caches")
            if self.draft_block_ids.numel() != self.block_ids.numel():
                raise ValueError(
                    f"draft_block_ids: {self.draft_block_ids.numel()} blocks; the target's "
                    f"transfer has {self.block_ids.numel()}"
                )

    @classmethod
    def of_ids(
        cls,
        kv_caches: list[torch.Tensor],
        block_ids: list[int],
        draft_caches: list[torch.Tensor] | None = None,
        draft_block_ids: list[int] | None = None,
    ) -> PagedLayers:
        """A transfer's layers from block id lists; ValueError naming the list for an id out of
        its pool's range (checked before anything is sent)."""
        device = kv_caches[0].device
        tensors = []
        for name, caches, ids in (
            ("block_ids", kv_caches, block_ids),
            ("draft_block_ids", draft_caches, draft_block_ids),
        ):
            if ids is None:
                continue
            if caches is None:
                raise ValueError(f"{name}: this side has no draft caches")
            num_blocks = caches[0].shape[1]
            bad = [b for b in ids if not 0 <= b < num_blocks]
            if bad:
                raise ValueError(f"{name}: {bad[0]} is not in [0, {num_blocks})")
            tensors.append(torch.tensor(ids, dtype=torch.long, device=device))
        return cls(kv_caches, tensors[0], draft_caches, tensors[1] if len(tensors) > 1 else None)

    @property
    def num_target(self) -> int:
        return len(self.caches)

    @property
    def num_draft(self) -> int:
        return len(self.draft_caches or []) if self.draft_block_ids is not None else 0

    @property
    def num_layers(self) -> int:
        return self.num_target + self.num_draft

    def split(self, start: int, end: int) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """The (caches, block ids) of each group's part of layers [start, end)."""
        parts = []
        if start < self.num_target:
            parts.append((self.caches[start : min(end, self.num_target)], self.block_ids))
        if end > self.num_target:
            assert self.draft_caches is not None and self.draft_block_ids is not None
            lo, hi = max(start, self.num_target) - self.num_target, end - self.num_target
            parts.append((self.draft_caches[lo:hi], self.draft_block_ids))
        return parts

    def layer_bytes(self, layer: int) -> int:
        """One transfer layer's bytes (K and V of every block)."""
        [(caches, ids)] = self.split(layer, layer + 1)
        return 2 * ids.numel() * caches[0][0, 0].nbytes

    def nbytes(self, start: int, end: int) -> int:
        return sum(self.layer_bytes(layer) for layer in range(start, end))

    def chunks(self, whole: bool = False) -> list[tuple[int, int]]:
        """This transfer's messages (`transfer_chunks`)."""
        draft_bytes = self.layer_bytes(self.num_target) if self.num_draft else 0
        return transfer_chunks(
            self.num_target, self.layer_bytes(0), self.num_draft, draft_bytes, whole
        )

    def row_iovecs(self, start: int, end: int) -> torch.Tensor:
        """iovecs of layers [start, end) in transfer order (`sockio.row_iovecs`: each layer's
        K rows, then its V rows), for vectored socket I/O straight from or into the caches."""
        parts = []
        for caches, ids in self.split(start, end):
            num_blocks = caches[0].shape[1]
            rows = torch.cat([ids, ids + num_blocks]).cpu()
            parts.append(sockio.row_iovecs(caches, rows))
        return sockio.merge_adjacent(torch.cat(parts)) if len(parts) > 1 else parts[0]

    def gather(
        self, start: int, end: int, blocks: torch.Tensor, draft_blocks: torch.Tensor | None
    ) -> None:
        """Copy layers [start, end) into their staging tensors (`staged_view`)."""
        for group_start, group_end in layer_groups(self.num_target, self.num_draft):
            lo, hi = max(start, group_start), min(end, group_end)
            if lo < hi:
                [(caches, ids)] = self.split(lo, hi)
                gather_blocks(caches, ids, out=staged_view(blocks, draft_blocks, lo, hi))

    def scatter(
        self,
        start: int,
        end: int,
        blocks: torch.Tensor,
        draft_blocks: torch.Tensor | None,
        head_range: tuple[int, int] | None = None,
    ) -> None:
        """Write staged layers [start, end) into the caches; `head_range`: the target's staged
        blocks hold only those of this side's KV heads (a draft is never sharded)."""
        for group_start, group_end in layer_groups(self.num_target, self.num_draft):
            lo, hi = max(start, group_start), min(end, group_end)
            if lo < hi:
                [(caches, ids)] = self.split(lo, hi)
                heads = head_range if group_start == 0 else None
                staged = staged_view(blocks, draft_blocks, lo, hi).to(caches[0].device)
                scatter_blocks(caches, ids, staged, heads)
