"""What a KV transfer carries and the handshake that checks both sides agree on it.

Blocks travel as one tensor per request, `[num_layers, P, num_blocks, block_size, h, D]`,
so the receiver can scatter them without knowing how the sender stored them. P is the cache's
planes (`num_planes`, engine/kv_cache_spec.py): 2 for K and V, 1 for a multi-head latent
attention model (DeepSeek-V2/V3), whose cache holds one compressed entry per token and layer
(h = 1, D = kv_lora_rank + qk_rope_head_dim); the handshake refuses a dense side facing an
MLA one. Either side may
be tensor-parallel with any TP size its model allows: each rank caches the KV heads
`kv_head_range` gives it (whole KV groups, as evenly as they divide, or one head replicated on
the ranks that share it; engine/parallel.py). A sender rank ships a receiver rank the heads
both hold that no lower sender rank holds too (`head_route`): every receiver rank gets each of
its heads exactly once, from `num_senders` ranks of the sending group, and nothing else.

A sending group may also be split into pipeline stages (`pp_size`; engine/pipeline.py): each
stage's ranks cache and ship the layers `layer_range` names, `[start, end)` of the model's,
and a receiver (one stage: it caches every layer) writes each stage's transfer into those
layers of its caches. A request is then complete once every stage's shipping ranks landed.

A channel whose layouts name a draft model (`DraftLayout`: speculative decoding whose draft
KV the prefill worker computes) may carry, after a transfer's target layers, the draft's
layers over the same number of blocks, `[draft layers, 2, num_blocks, block_size, Hd, Dd]`:
the draft's own block ids, heads and head size, never sharded (`kv_transfer/layers.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

import torch

from duet.engine.parallel import kv_head_range
from duet.engine.pipeline import stage_layers

KV_LAYOUT_VERSION = 8
"""2: torch_dist ships a transfer in chunks of layers (header `chunks`); 3: one header lists
the transfers queued together, and layer-wise transfers send their metadata as a trailer;
4: a transfer may carry a draft model's layers after the target's (`KVLayout.draft`);
5: torch_dist and tcp cut a transfer into pieces no larger than the receiver's
`max_piece_bytes`, said in its handshake verdict (`kv_transfer/chunks.py`);
6: a prefill rank ships each decode rank only the KV heads that rank caches (`head_route`),
and the ranks of a tensor-parallel decode worker settle each transfer together;
7: a layout names its cache's planes (`num_planes`: 1 for MLA's latent entries);
8: a layout names its pipeline stage (`pp_size`, `pp_stage`): a transfer carries that
stage's layers only."""


class HandshakeError(RuntimeError):
    """The two sides of a channel disagree on what a block is; nothing is transferred."""


@dataclass(frozen=True)
class DraftLayout:
    """A draft model's KV cache: its layers and whole head layout (the target's dtype and
    block size; a draft is never sharded)."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of_caches(cls, model_id: str, draft_caches: list[torch.Tensor]) -> DraftLayout:
        _, _, _, num_kv_heads, head_dim = draft_caches[0].shape
        return cls(model_id, len(draft_caches), num_kv_heads, head_dim)


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str  # "float32", "bfloat16", ...
    block_size: int
    num_layers: int
    num_kv_heads: int  # of the whole model (MLA: 1)
    head_dim: int  # values per head and token (MLA: kv_lora_rank + qk_rope_head_dim)
    tp_size: int = 1
    tp_rank: int = 0
    version: int = KV_LAYOUT_VERSION
    draft: DraftLayout | None = None
    """The draft model whose layers this side's transfers may carry (None: target only)."""
    num_planes: int = 2
    """2: K and V; 1: multi-head latent attention's compressed entries."""
    pp_size: int = 1
    """Pipeline stages of this side's group (a receiver has one)."""
    pp_stage: int = 0

    @property
    def layer_range(self) -> tuple[int, int]:
        """[start, end) of the model's layers this side caches (`stage_layers`): all of them
        without pipeline stages; a transfer from this side carries those."""
        return stage_layers(self.num_layers, self.pp_size, self.pp_stage)

    @property
    def group_rank(self) -> int:
        """This rank's place in its group: stage x tp_size + TP rank (the lowest is the
        reference for what every rank's transfer carries alike, such as the first token)."""
        return self.pp_stage * self.tp_size + self.tp_rank

    @property
    def num_local_layers(self) -> int:
        start, end = self.layer_range
        return end - start

    @property
    def head_range(self) -> tuple[int, int]:
        """[start, end) of the model's KV heads this side caches (`kv_head_range`)."""
        return kv_head_range(self.num_kv_heads, self.tp_size, self.tp_rank)

    @property
    def shipped_range(self) -> tuple[int, int]:
        """[start, end) of the heads this rank ships: its own, or none when a lower rank
        caches the same (replicated) head and ships it instead."""
        start, end = self.head_range
        below = kv_head_range(self.num_kv_heads, self.tp_size, self.tp_rank - 1)
        if self.tp_rank and below[0] == start:
            return start, start
        return start, end

    def rank(self, tp_rank: int) -> KVLayout:
        """Rank `tp_rank` of this side's group."""
        return dataclasses.replace(self, tp_rank=tp_rank)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        draft = data.get("draft")
        return cls(**{**data, "draft": DraftLayout(**draft) if draft is not None else None})

    def with_draft(self, model_id: str, draft_caches: list[torch.Tensor]) -> KVLayout:
        """This layout with a draft model's layers (caches of this dtype and block size)."""
        first = draft_caches[0]
        if (
            str(first.dtype).removeprefix("torch.") != self.dtype
            or first.shape[2] != self.block_size
        ):
            raise ValueError(
                f"draft_caches: {first.dtype} blocks of {first.shape[2]} tokens; the target's "
                f"are {self.dtype} blocks of {self.block_size}"
            )
        if self.tp_size != 1 or self.pp_size != 1:
            raise ValueError("draft_caches: a draft's KV travels from unsharded caches only")
        return dataclasses.replace(self, draft=DraftLayout.of_caches(model_id, draft_caches))

    @classmethod
    def of_caches(
        cls,
        model_id: str,
        kv_caches: list[torch.Tensor],
        num_kv_heads: int,
        tp_size: int = 1,
        tp_rank: int = 0,
        pp_size: int = 1,
        pp_stage: int = 0,
        num_layers: int | None = None,
    ) -> KVLayout:
        """`kv_caches`: this side's, one per layer it caches; `num_layers`: the model's (needed
        with pipeline stages, whose caches are their layers only)."""
        num_planes, _, block_size, _, head_dim = kv_caches[0].shape
        layout = cls(
            model_id=model_id,
            dtype=str(kv_caches[0].dtype).removeprefix("torch."),
            block_size=block_size,
            num_layers=len(kv_caches) if num_layers is None else num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_planes=num_planes,
            tp_size=tp_size,
            tp_rank=tp_rank,
            pp_size=pp_size,
            pp_stage=pp_stage,
        )
        if layout.num_local_layers != len(kv_caches):
            raise ValueError(
                f"kv_caches: {len(kv_caches)} layers; stage {pp_stage} of {pp_size} caches "
                f"{layout.num_local_layers} of the model's {layout.num_layers}"
            )
        return layout


@dataclass(frozen=True)
class HeadRoute:
    """The KV heads one sender rank ships to one receiver rank: the model's heads
    [start, end), at `src` among the sender's cached heads and at `dst` among the receiver's
    (both [start, end) of the local head axis)."""

    start: int
    end: int
    src: tuple[int, int]
    dst: tuple[int, int]
    src_whole: bool  # the sender ships every head it caches
    dst_whole: bool  # they are every head the receiver caches

    @property
    def num_heads(self) -> int:
        return self.end - self.start

    @property
    def src_slice(self) -> tuple[int, int] | None:
        """The sender's heads to ship, None for all of them."""
        return None if self.src_whole else self.src

    @property
    def dst_slice(self) -> tuple[int, int] | None:
        """Where they land among the receiver's heads, None for all of them."""
        return None if self.dst_whole else self.dst


def head_route(sender: KVLayout, receiver: KVLayout) -> HeadRoute | None:
    """What `sender` ships `receiver` (both of one model: `check_compatible`), None when
    nothing: the receiver's heads among those the sender ships (`KVLayout.shipped_range`)."""
    (s_start, s_end), (r_start, r_end) = sender.head_range, receiver.head_range
    ship_start, ship_end = sender.shipped_range
    start, end = max(ship_start, r_start), min(ship_end, r_end)
    if start >= end:
        return None
    return HeadRoute(
        start, end, (start - s_start, end - s_start), (start - r_start, end - r_start),
        (start, end) == (s_start, s_end), (start, end) == (r_start, r_end),
    )  # fmt: skip


def num_senders(sender: KVLayout, receiver: KVLayout) -> int:
    """How many ranks of `sender`'s group ship `receiver` a part of each request's KV: those
    of one stage that hold its heads, in every pipeline stage."""
    per_stage = sum(head_route(sender.rank(r), receiver) is not None for r in range(sender.tp_size))
    return per_stage * sender.pp_size


def check_compatible(sender: KVLayout, receiver: KVLayout) -> None:
    """Raise `HandshakeError` naming every field the two sides disagree on. TP sizes may
    differ (`head_route` maps one onto the other), everything else must match, and the
    sender rank must hold heads the receiver rank caches: a channel between two ranks
    with nothing to move is a misrouted request, refused."""
    if sender.version != receiver.version:
        # NOTE: alone, since the other fields of another version may not mean the same.
        raise HandshakeError(
            f"KV layout version: sender {sender.version} != receiver {receiver.version}; "
            "prefill and decode workers of different duet releases cannot exchange KV"
        )
    if sender.num_planes != receiver.num_planes:
        # NOTE: alone: heads and sizes of a dense and a latent cache do not compare.
        raise HandshakeError(
            f"KV layout mismatch; refusing to transfer: the sender caches "
            f"{_planes_kind(sender.num_planes)} (num_planes {sender.num_planes}), the receiver "
            f"{_planes_kind(receiver.num_planes)} (num_planes {receiver.num_planes}); a dense "
            "model and a multi-head latent attention model cannot exchange KV"
        )
    fields = (
        "model_id",
        "dtype",
        "block_size",
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "draft",
    )
    diffs = [
        f"{name}: sender {getattr(sender, name)!r} != receiver {getattr(receiver, name)!r}"
        for name in fields
        if getattr(sender, name) != getattr(receiver, name)
    ]
    for side, layout in (("sender", sender), ("receiver", receiver)):
        if not 0 <= layout.tp_rank < layout.tp_size:
            diffs.append(
                f"{side} tp_rank: must be in [0, tp_size={layout.tp_size}); got {layout.tp_rank}"
            )
        if not 0 <= layout.pp_stage < layout.pp_size <= max(layout.num_layers, 1):
            diffs.append(
                f"{side} pp_stage: must be in [0, pp_size={layout.pp_size}) with at most "
                f"num_layers ({layout.num_layers}) stages; got {layout.pp_stage}"
            )
    if receiver.pp_size != 1:
        diffs.append(
            f"receiver pp_size: a receiving side caches every layer (pp_size 1); got "
            f"{receiver.pp_size}"
        )
    if not diffs and head_route(sender, receiver) is None:
        diffs.append(
            f"the sender (tp_rank {sender.tp_rank} of {sender.tp_size}, ships KV heads "
            f"{list(sender.shipped_range)}) has none of the receiver's (tp_rank "
            f"{receiver.tp_rank} of {receiver.tp_size}, KV heads {list(receiver.head_range)})"
        )
    if diffs:
        raise HandshakeError("KV layout mismatch; refusing to transfer: " + "; ".join(diffs))


def _planes_kind(num_planes: int) -> str:
    return "K and V per head (dense attention)" if num_planes == 2 else "MLA's latent entries"


def checked_route(sender: KVLayout, receiver: KVLayout) -> HeadRoute:
    """`check_compatible`, then the route between the two ranks (never None then)."""
    check_compatible(sender, receiver)
    route = head_route(sender, receiver)
    assert route is not None
    return route
