"""How a transfer is cut into messages of whole layers (both network backends)."""

from __future__ import annotations

CHUNK_MIN_BYTES = 2 << 20
"""A transfer goes as chunks of whole layers of at least this size (one chunk when smaller):
smaller chunks overlap gather, wire and scatter more, but each costs a message."""


def layer_chunks(num_layers: int, layer_bytes: int) -> list[tuple[int, int]]:
    """[start, end) layer ranges of a transfer whose layers hold `layer_bytes` each."""
    per_chunk = min(num_layers, max(1, -(-CHUNK_MIN_BYTES // max(layer_bytes, 1))))
    return [
        (start, min(start + per_chunk, num_layers)) for start in range(0, num_layers, per_chunk)
    ]
