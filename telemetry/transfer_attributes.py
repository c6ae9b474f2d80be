"""A KV transfer's attributes on a trace's spans: the router's `duet.kv_transfer` and the
prefill worker's `duet.prefill_worker.kv_send` carry the same (docs/observability.md)."""

from __future__ import annotations


def kv_transfer_attributes(
    num_bytes: int, duration_s: float, num_chunks: int, link_gbps: float
) -> dict[str, int | float]:
    """`duet.kv_transfer.*`: the bytes, time, achieved GB/s and chunks; with a probed link
    rate (`link_gbps` > 0, docs/kv_transfer.md), that rate and the achieved one's fraction of
    it. Absent until the sender's probe measured the link."""
    gbps = num_bytes / duration_s / 1e9 if duration_s > 0 else 0.0
    attributes: dict[str, int | float] = {
        "duet.kv_transfer.bytes": num_bytes,
        "duet.kv_transfer.duration_s": duration_s,
        "duet.kv_transfer.gbps": gbps,
        "duet.kv_transfer.chunks": num_chunks,
    }
    if link_gbps > 0:
        attributes["duet.kv_transfer.link_gbps"] = link_gbps
        attributes["duet.kv_transfer.link_fraction"] = gbps / link_gbps
    return attributes
