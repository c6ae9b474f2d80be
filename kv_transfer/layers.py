"""The layers one transfer carries: the target model's and, on a channel whose layouts name a
draft model (`KVLayout.draft`), optionally the draft's after them, over the same number of
blocks but at the draft pool's own block ids, with its own heads and head size.

Transfer layer i < num_target is target layer i; layer num_target + j is draft layer j. The
layers of one group share a shape, so a transfer is cut into pieces that never span both
(`TransferShape.pieces`: whole layers, or a layer's blocks when one layer is larger than a
piece may be) and each piece moves as target layers always did: as rows of the paged caches
(`PagedLayers`: the tcp backend's vectored I/O, gather and scatter), or through a slot of the
staging pool holding `[end - start, P, blocks, BS, h, D]` (kv_transfer/staging.py; P: the
cache's planes, 2 for K and V, 1 for multi-head latent attention's entries).

The draft's KV must be in its caches before the transfer opens (`send` or `begin`): the
prefill worker computes the draft over the prompt first, so its pieces are ready at once while
the target's last pass is still writing its layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from duet.kv_transfer import sockio
from duet.kv_transfer.blocks import gather_blocks, plane_rows, scatter_blocks
from duet.kv_transfer.chunks import Piece, plan_pieces


def layer_groups(num_target: int, num_draft: int) -> list[tuple[int, int]]:
    """[start, end) transfer layers of each group: the target's, then the draft's if any."""
    return [(0, num_target)] + ([(num_target, num_target + num_draft)] if num_draft else [])


@dataclass(frozen=True)
class TransferShape:
    """A transfer's layers as staged: the target's `[num_target, planes, num_blocks, *row]`,
    then the draft's `[num_draft, draft_planes, num_blocks, *draft_row]` (row: `[BS, h, D]`,
    in the sending side's heads), and their pieces (`chunks.Piece`). What both sides agree a
    transfer is."""

    num_target: int
    num_blocks: int
    row: tuple[int, ...]
    element_size: int
    num_draft: int = 0
    draft_row: tuple[int, ...] = ()
    planes: int = 2
    """The target cache's planes (engine/kv_cache_spec.py): 2 (K, V) or 1 (MLA)."""
    draft_planes: int = 2

    @property
    def num_layers(self) -> int:
        return self.num_target + self.num_draft

    @property
    def num_cells(self) -> int:
        """(layer, block) pairs: what every piece of the transfer covers together."""
        return self.num_layers * self.num_blocks

    def groups(self) -> list[tuple[int, int, int]]:
        """Each group's [start, end) layers and the bytes of one block (every plane) in one
        layer."""
        rows = [(self.planes, self.row), (self.draft_planes, self.draft_row)]
        return [
            (start, end, planes * math.prod(row) * self.element_size)
            for (start, end), (planes, row) in zip(
                layer_groups(self.num_target, self.num_draft), rows, strict=False
            )
        ]

    def pieces(self, max_bytes: int, whole: bool = False) -> list[Piece]:
        """The transfer's messages (`chunks.plan_pieces`)."""
        return plan_pieces(self.groups(), self.num_blocks, max_bytes, whole)

    def piece_shape(self, piece: Piece) -> tuple[int, ...]:
        """`[end - start, planes, last - first, *row]`; ValueError for a piece out of range or
        spanning both groups (a peer's message that cannot be)."""
        start, end, first, last = piece
        in_target = 0 <= start < end <= self.num_target
        in_draft = self.num_target <= start < end <= self.num_layers
        if not (in_target or in_draft) or not 0 <= first < last <= self.num_blocks:
            raise ValueError(f"piece {list(piece)}: not within one group of {self}")
        if in_target:
            return (end - start, self.planes, last - first, *self.row)
        return (end - start, self.draft_planes, last - first, *self.draft_row)

    def piece_nbytes(self, piece: Piece) -> int:
        return math.prod(self.piece_shape(piece)) * self.element_size


def staged_shape(
    shape: list[int], draft_shape: list[int] | None, dtype: torch.dtype
) -> TransferShape:
    """The `TransferShape` a peer described as `[L, P, n, *row]` (and the draft's `[Ld, Pd,
    n, *draft_row]`; P: 2 or 1 planes); ValueError for one that cannot be."""
    num_target, planes, num_blocks, *row = (int(d) for d in shape)
    draft = [int(d) for d in draft_shape] if draft_shape is not None else [0, 2, num_blocks]
    planes_ok = planes in (1, 2) and draft[1] in (1, 2)
    if not planes_ok or draft[2] != num_blocks or min(shape) < 1:
        raise ValueError(f"shape {shape}, draft_shape {draft_shape}: not a transfer's")
    element_size = torch.empty((), dtype=dtype).element_size()
    return TransferShape(
        num_target, num_blocks, tuple(row), element_size, draft[0], tuple(draft[3:]), planes,
        draft[1],
    )  # fmt: skip


def piece_cells(piece: Piece) -> int:
    """The (layer, block) pairs a piece covers."""
    start, end, first, last = piece
    return (end - start) * (last - first)


@dataclass(frozen=True)
class PagedLayers:
    """A transfer's layers in one side's paged caches (per layer [2, NB, BS, h, D]): the
    target's `caches` at `block_ids`, then, when `draft_block_ids` is given, `draft_caches` at
    those. Both lists of ids have one entry per transferred block, in prompt order."""

    caches: list[torch.Tensor]
    block_ids: torch.Tensor  # [n] long, on the caches' device
    draft_caches: list[torch.Tensor] | None = None
    draft_block_ids: torch.Tensor | None = None  # [n] long
    heads: tuple[int, int] | None = None
    """The target's KV heads [start, end) of this side's that the transfer moves (a route
    between tensor-parallel ranks, `layout.head_route`); None: all of them."""

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
        heads: tuple[int, int] | None = None,
    ) -> PagedLayers:
        """A transfer's layers from block id lists (`heads`: the field's); ValueError naming the
        list for an id out of its pool's range (checked before anything is sent)."""
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
        draft = tensors[1] if len(tensors) > 1 else None
        return cls(kv_caches, tensors[0], draft_caches, draft, heads)

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
        """The (caches, block ids) of each group's part of layers [start, end); the target's
        caches narrowed to `heads`."""
        parts = []
        if start < self.num_target:
            caches = self.caches[start : min(end, self.num_target)]
            if self.heads is not None:
                lo, hi = self.heads
                caches = [c[:, :, :, lo:hi] for c in caches]
            parts.append((caches, self.block_ids))
        if end > self.num_target:
            assert self.draft_caches is not None and self.draft_block_ids is not None
            lo, hi = max(start, self.num_target) - self.num_target, end - self.num_target
            parts.append((self.draft_caches[lo:hi], self.draft_block_ids))
        return parts

    @property
    def shape(self) -> TransferShape:
        """This side's staged layout of the transfer."""
        first = self.caches[0]
        row = tuple(first.shape[2:])
        if self.heads is not None:
            row = (row[0], self.heads[1] - self.heads[0], row[2])
        draft = self.draft_caches[0] if self.num_draft and self.draft_caches else None
        return TransferShape(
            self.num_target, self.block_ids.numel(), row,
            first.element_size(), self.num_draft,
            tuple(draft.shape[2:]) if draft is not None else (), first.shape[0],
            draft.shape[0] if draft is not None else 2,
        )  # fmt: skip

    def _piece_part(self, piece: Piece) -> tuple[list[torch.Tensor], torch.Tensor]:
        start, end, first, last = piece
        [(caches, ids)] = self.split(start, end)
        return caches, ids[first:last]

    def piece_iovecs(self, piece: Piece) -> torch.Tensor:
        """iovecs of a piece in its staged order (`sockio.row_iovecs`: each layer's K rows of
        the piece's blocks, then their V rows, or MLA's one plane's; with `heads`, each row's
        tokens' slices of them), for vectored socket I/O straight from or into the caches."""
        caches, ids = self._piece_part(piece)
        rows = plane_rows(ids, caches[0].shape[1], caches[0].shape[0]).cpu()
        if self.heads is not None and piece[0] < self.num_target:
            return sockio.head_iovecs(self.caches[piece[0] : piece[1]], rows, self.heads)
        return sockio.row_iovecs(caches, rows)

    def gather_piece(self, piece: Piece, out: torch.Tensor) -> None:
        """Copy a piece out of the caches into `out` (`TransferShape.piece_shape`)."""
        caches, ids = self._piece_part(piece)
        gather_blocks(caches, ids, out=out)

    def scatter_piece(self, piece: Piece, data: torch.Tensor) -> None:
        """Write a staged piece into the caches (a target piece into `heads` of them: a draft
        is never sharded)."""
        caches, ids = self._piece_part(piece)  # the target's narrowed to `heads`: views
        scatter_blocks(caches, ids, data.to(caches[0].device))
