"""Where a side's caches are, and the block-to-block descriptors of a transfer between two sides.

Each side registers every cache tensor whole, once (`CacheRegions.of_caches`), and tells the
other at the join where they are: per layer its base address and number of blocks, and the
shape of a block's row. A layer's cache is `[P, NB, BS, h, D]`: row `p * NB + b` (K rows, then
V rows; multi-head latent attention's one plane: its entries) is block b's part of plane p,
`BS * h * D` elements, contiguous. A transfer is then a list of
(local address, remote address, length) triples, one per row moved, or, where one side holds
KV heads than the transfer moves (tensor-parallel ranks: `layout.head_route`), one per token of
a row: the moved heads are a slice of each token of that side's rows.
Runs that continue each other on both sides are merged into one descriptor (fresh pools hand
out consecutive blocks; each descriptor costs the transport an operation).

Never a staging copy: the addresses are the caches' own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class GroupRegions:
    """One group of layers (the target's, or a draft's) in one side's caches."""

    bases: list[int]  # per layer: the cache tensor's address
    num_planes: int  # 2: K and V; 1: MLA's entries (engine/kv_cache_spec.py)
    num_blocks: int
    block_size: int
    heads: int  # KV heads this side holds
    head_bytes: int  # one head of one token

    @classmethod
    def of_caches(cls, caches: list[torch.Tensor]) -> GroupRegions:
        num_planes, num_blocks, block_size, heads, head_dim = caches[0].shape
        return cls(
            [c.data_ptr() for c in caches],
            num_planes,
            num_blocks,
            block_size,
            heads,
            head_dim * caches[0].element_size(),
        )

    @property
    def row_bytes(self) -> int:
        return self.block_size * self.heads * self.head_bytes


@dataclass(frozen=True)
class CacheRegions:
    """A side's registered caches: the target's layers, then a draft's (when it has one)."""

    mem_type: str  # "DRAM" or "VRAM"
    device_id: int  # the CUDA device's index (0 for DRAM)
    target: GroupRegions
    draft: GroupRegions | None = None

    @classmethod
    def of_caches(
        cls, kv_caches: list[torch.Tensor], draft_caches: list[torch.Tensor] | None = None
    ) -> CacheRegions:
        device = kv_caches[0].device
        return cls(
            "VRAM" if device.type == "cuda" else "DRAM",
            device.index or 0,
            GroupRegions.of_caches(kv_caches),
            GroupRegions.of_caches(draft_caches) if draft_caches else None,
        )

    def layers(self, start: int, end: int) -> CacheRegions:
        """These regions with the target's layers [start, end) only (those a pipeline stage
        of the other side moves): its transfer layer i is layer start + i here."""
        if (start, end) == (0, len(self.target.bases)):
            return self
        target = dataclasses.replace(self.target, bases=self.target.bases[start:end])
        return dataclasses.replace(self, target=target)

    def group(self, draft: bool) -> GroupRegions:
        group = self.draft if draft else self.target
        if group is None:
            raise ValueError("draft layers: this side registered no draft caches")
        return group

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheRegions:
        draft = data.get("draft")
        return cls(
            data["mem_type"],
            int(data["device_id"]),
            GroupRegions(**data["target"]),
            GroupRegions(**draft) if draft else None,
        )


@dataclass(frozen=True)
class Side:
    """One end of a transfer within one group: its regions, the blocks (one per transferred
    block, in prompt order) and the first of its heads the transfer moves."""

    regions: GroupRegions
    block_ids: np.ndarray  # [n] int64
    head_offset: int = 0


def pair_descs(
    local: Side,
    remote: Side,
    layers: range,
    devices: tuple[int, int] = (0, 0),
    num_heads: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) descriptor arrays `[N, 3]` (address, length, device id: `devices`, the
    two sides' `CacheRegions.device_id`) for layers `layers` of the group, moving `num_heads`
    heads (default: every head of both sides, which then hold as many): the same N on both
    sides, lengths equal pair by pair, adjacent runs merged."""
    moved = num_heads if num_heads is not None else local.regions.heads
    for side in (local, remote):
        if not 0 <= side.head_offset <= side.head_offset + moved <= side.regions.heads:
            raise ValueError(f"heads [{side.head_offset}, +{moved}) of {side.regions.heads}")
    if local.regions.head_bytes != remote.regions.head_bytes:
        raise ValueError("head sizes differ between the two sides")
    if local.regions.num_planes != remote.regions.num_planes:
        raise ValueError("the two sides' caches have different planes (dense K|V vs MLA)")
    if local.block_ids.shape != remote.block_ids.shape:
        raise ValueError("the two sides move different numbers of blocks")
    sliced = moved != local.regions.heads or moved != remote.regions.heads
    local_addr = _addresses(local, layers, sliced)
    remote_addr = _addresses(remote, layers, sliced)
    piece = moved * local.regions.head_bytes * (1 if sliced else local.regions.block_size)
    return _merge(local_addr, remote_addr, piece, devices)


def _addresses(side: Side, layers: range, sliced: bool) -> np.ndarray:
    """Start addresses of every piece, in transfer order: per layer its K rows then its V rows
    (MLA: its entry rows), and, `sliced`, per row its tokens."""
    g = side.regions
    ids = side.block_ids.astype(np.int64)
    rows = np.concatenate([ids + p * g.num_blocks for p in range(g.num_planes)])  # [P n]
    offsets = rows * g.row_bytes  # [P n]
    if sliced:
        token = np.arange(g.block_size, dtype=np.int64) * g.heads * g.head_bytes  # [BS]
        offsets = (offsets[:, None] + token[None, :]).reshape(-1)  # [P n BS]
        offsets += side.head_offset * g.head_bytes
    bases = np.asarray([g.bases[layer] for layer in layers], dtype=np.int64)  # [L]
    return (bases[:, None] + offsets[None, :]).reshape(-1)  # [L * pieces]


def _merge(
    local: np.ndarray, remote: np.ndarray, piece: int, devices: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Merge pieces that continue the previous one on both sides."""
    if local.size == 0:
        empty = np.zeros((0, 3), dtype=np.uint64)
        return empty, empty.copy()
    breaks = np.ones(local.size, dtype=bool)
    breaks[1:] = (local[1:] != local[:-1] + piece) | (remote[1:] != remote[:-1] + piece)
    starts = np.flatnonzero(breaks)
    lengths = np.diff(np.append(starts, local.size)) * piece
    out = []
    for addr, device in zip((local, remote), devices, strict=True):
        descs = np.zeros((starts.size, 3), dtype=np.uint64)
        descs[:, 0] = addr[starts]
        descs[:, 1] = lengths
        descs[:, 2] = device
        out.append(descs)
    return out[0], out[1]


@dataclass(frozen=True)
class Blocks:
    """One side's blocks of a transfer: the target's, and the draft's when it moves too."""

    regions: CacheRegions
    block_ids: np.ndarray  # [n] int64
    draft_block_ids: np.ndarray | None = None
    head_offset: int = 0  # the first of this side's heads the transfer moves
    num_heads: int | None = None  # how many (a route's: `layout.head_route`); None: all


def layer_descs(
    local: Blocks, remote: Blocks, start: int, end: int
) -> tuple[np.ndarray, np.ndarray]:
    """Descriptors (`pair_descs`) of transfer layers [start, end): target layers first, then
    the draft's (transfer layer `num_target + j` is draft layer j), each group with its own
    blocks and head layout (a draft is never sharded); both sides name the heads moved."""
    if local.num_heads != remote.num_heads:
        raise ValueError(f"the sides move {local.num_heads} and {remote.num_heads} heads")
    num_target = len(local.regions.target.bases)
    parts = []
    if start < num_target:
        parts.append(
            pair_descs(
                Side(local.regions.target, local.block_ids, local.head_offset),
                Side(remote.regions.target, remote.block_ids, remote.head_offset),
                range(start, min(end, num_target)),
                (local.regions.device_id, remote.regions.device_id),
                local.num_heads,
            )
        )
    if end > num_target:
        if local.draft_block_ids is None or remote.draft_block_ids is None:
            raise ValueError("draft layers: no draft blocks on one side")
        parts.append(
            pair_descs(
                Side(local.regions.group(True), local.draft_block_ids),
                Side(remote.regions.group(True), remote.draft_block_ids),
                range(max(start, num_target) - num_target, end - num_target),
                (local.regions.device_id, remote.regions.device_id),
            )
        )
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
