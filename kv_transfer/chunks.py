"""How a transfer is cut into messages (both network backends): pieces of whole layers, or,
where one layer is larger than a piece may be, of a layer's blocks."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

CHUNK_MIN_BYTES = 2 << 20
"""A transfer goes as chunks of whole layers of at least this size (one chunk when smaller):
smaller chunks overlap gather, wire and scatter more, but each costs a message."""

Piece = tuple[int, int, int, int]
"""Transfer layers [start, end) x blocks [first, last): one message, staged as
`[end - start, 2, last - first, BS, h, D]` (within one layer group; kv_transfer/layers.py)."""


def layer_chunks(num_layers: int, layer_bytes: int) -> list[tuple[int, int]]:
    """[start, end) layer ranges of a transfer whose layers hold `layer_bytes` each."""
    per_chunk = min(num_layers, max(1, -(-CHUNK_MIN_BYTES // max(layer_bytes, 1))))
    return [
        (start, min(start + per_chunk, num_layers)) for start in range(0, num_layers, per_chunk)
    ]


def plan_pieces(
    groups: Sequence[tuple[int, int, int]],
    num_blocks: int,
    max_bytes: int,
    whole: bool = False,
) -> list[Piece]:
    """A transfer's pieces, in order: `groups` holds each layer group's [start, end) transfer
    layers and the bytes of one block's K and V in one of its layers. Within a group, pieces
    of whole layers (`layer_chunks`, or the whole group when `whole`) of at most `max_bytes`;
    a layer larger than that goes as pieces of its blocks, equal to within one block.
    ValueError when one block of one layer alone exceeds `max_bytes` (the staging pool is too
    small for the model)."""
    pieces: list[Piece] = []
    for start, end, block_bytes in groups:
        layer_bytes = block_bytes * num_blocks
        if layer_bytes <= max_bytes:
            if whole:
                per = end - start
            else:
                per = layer_chunks(end - start, layer_bytes)[0][1]
            per = max(1, min(per, max_bytes // layer_bytes))
            pieces += [(s, min(s + per, end), 0, num_blocks) for s in range(start, end, per)]
            continue
        per_piece = max_bytes // block_bytes
        if per_piece < 1:
            raise ValueError(
                f"staging_bytes: a piece may hold {max_bytes} bytes, less than one block of "
                f"one layer ({block_bytes} bytes); raise the staging pool"
            )
        num_parts = -(-num_blocks // per_piece)
        bounds = [num_blocks * i // num_parts for i in range(num_parts + 1)]
        for layer in range(start, end):
            pieces += [(layer, layer + 1, lo, hi) for lo, hi in itertools.pairwise(bounds)]
    return pieces
