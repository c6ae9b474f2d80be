"""What a KV transfer carries and the handshake that checks both sides agree on it.

Blocks travel as one tensor per request, `[num_layers, 2, num_blocks, block_size, Hkv, D]`,
so the receiver can scatter them without knowing how the sender stored them. A sender with
tensor parallelism T ships the heads of its shard (rank r holds KV heads [r*H/T, (r+1)*H/T));
a receiver with a smaller TP reassembles heads from several senders.

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

KV_LAYOUT_VERSION = 5
"""2: torch_dist ships a transfer in chunks of layers (header `chunks`); 3: one header lists
the transfers queued together, and layer-wise transfers send their metadata as a trailer;
4: a transfer may carry a draft model's layers after the target's (`KVLayout.draft`);
5: torch_dist and tcp cut a transfer into pieces no larger than the receiver's
`max_piece_bytes`, said in its handshake verdict (`kv_transfer/chunks.py`)."""


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
    num_kv_heads: int  # of the whole model
    head_dim: int
    tp_size: int = 1
    tp_rank: int = 0
    version: int = KV_LAYOUT_VERSION
    draft: DraftLayout | None = None
    """The draft model whose layers this side's transfers may carry (None: target only)."""

    @property
    def heads_per_rank(self) -> int:
        return self.num_kv_heads // self.tp_size

    @property
    def head_range(self) -> tuple[int, int]:
        """[start, end) of the model's KV heads this side holds."""
        return self.tp_rank * self.heads_per_rank, (self.tp_rank + 1) * self.heads_per_rank

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
        if self.tp_size != 1:
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
    ) -> KVLayout:
        _, _, block_size, _, head_dim = kv_caches[0].shape
        return cls(
            model_id=model_id,
            dtype=str(kv_caches[0].dtype).removeprefix("torch."),
            block_size=block_size,
            num_layers=len(kv_caches),
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            tp_size=tp_size,
            tp_rank=tp_rank,
        )


def check_compatible(sender: KVLayout, receiver: KVLayout) -> None:
    """Raise `HandshakeError` naming every field the two sides disagree on. TP sizes may
    differ (heads are reassembled), everything else must match."""
    if sender.version != receiver.version:
        # NOTE: alone, since the other fields of another version may not mean the same.
        raise HandshakeError(
            f"KV layout version: sender {sender.version} != receiver {receiver.version}; "
            "prefill and decode workers of different duet releases cannot exchange KV"
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
    if sender.num_kv_heads % sender.tp_size or receiver.num_kv_heads % receiver.tp_size:
        diffs.append("num_kv_heads is not divisible by a side's tp_size")
    if diffs:
        raise HandshakeError("KV layout mismatch; refusing to transfer: " + "; ".join(diffs))


def receiver_head_slice(sender: KVLayout, receiver: KVLayout) -> tuple[int, int] | None:
    """Where a sender's KV heads land among the receiver's heads, as [start, end) in the
    receiver's cache; None when both hold the same heads. Raises HandshakeError when the
    sender's heads are not all among the receiver's."""
    if sender.head_range == receiver.head_range:
        return None
    (s_start, s_end), (r_start, r_end) = sender.head_range, receiver.head_range
    if not (r_start <= s_start and s_end <= r_end):
        raise HandshakeError(
            f"sender heads {sender.head_range} are not among receiver heads {receiver.head_range}"
        )
    return s_start - r_start, s_end - r_start
