"""A torch_dist channel: the store keys both sides use, and the handshake's checks (the link a
channel's tensors go over is `link.py`)."""

from __future__ import annotations

import datetime
import itertools
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from duet.kv_transfer.layout import HandshakeError, KVLayout
from duet.kv_transfer.torch_dist.link import PairLink

logger = logging.getLogger(__name__)

ACCEPT_QUEUE = "duet/kv/accept"
IDLE_POP_S = 300.0  # a receiver thread's blocking wait for the next channel or transfer


@dataclass
class Channel:
    """A sender's channel to one receiver."""

    cid: str
    store: dist.Store  # headers and trailers (writes, which do not wait for the receiver)
    ack_store: dist.Store  # the ack thread's own client: its reads block while a receiver stalls
    link: PairLink
    peer_layout: KVLayout
    tags: itertools.count[int]
    probes: bool = False  # the receiver takes link probes (probe.py; it said so at the handshake)
    max_piece_bytes: int = 0  # the largest piece both sides' staging pools take
    heads: tuple[int, int] | None = None  # the sender's KV heads it moves (None: all)
    progress_s: float = 0.0  # send thread: when an operation was last posted or completed
    failed: bool = False  # send thread: aborted; never used again


def meta_key(cid: str, request_id: str) -> str:
    """Where a layer-wise transfer's trailer (its metadata) waits for the receiver."""
    return f"{cid}/meta/{request_id}"


def ack_key(cid: str, request_id: str) -> str:
    """Where the receiver acknowledges a transfer whose blocks it wrote."""
    return f"{cid}/ack/{request_id}"


def fetch_json(store: dist.Store, key: str) -> dict[str, Any] | None:
    """The JSON object under `key` (deleted once read), or None while it is not there (or the
    store cannot be read: the receiver's `expect` deadline then fails the request)."""
    try:
        if not store.check([key]):
            return None
        value: dict[str, Any] = json.loads(store.get(key))
        store.delete_key(key)
    except Exception as e:
        logger.warning("reading %s from the KV store failed: %s", key, e)
        return None
    return value


def as_timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def check_emulation(device: torch.device, emulate_nccl: bool) -> None:
    if emulate_nccl and device.type != "cpu":
        raise ValueError(
            f"emulate_nccl: emulates NCCL for CPU caches; caches on {device} use NCCL itself"
        )


def check_link(sender: str, receiver: str) -> None:
    """Refuse a channel whose sides would not speak the same way."""
    if sender != receiver:
        raise HandshakeError(
            f"link: sender {sender!r} != receiver {receiver!r} (set DUET_KV_EMULATE_NCCL "
            "alike on both sides)"
        )


def sender_order(header: dict[str, Any]) -> list[tuple[int, int]]:
    """The header's `order`: its (transfer, chunk) pairs in the order the sender sends them,
    which the receiver posts its receives in. ValueError unless every chunk of every transfer
    appears once, each transfer's in order (a receiver cannot follow anything else)."""
    order = [(int(t), int(k)) for t, k in header["order"]]
    num_chunks = [len(transfer["chunks"]) for transfer in header["transfers"]]
    next_chunk = [0] * len(num_chunks)
    for t, k in order:
        if not 0 <= t < len(num_chunks) or k != next_chunk[t]:
            raise ValueError(f"order: chunk {k} of transfer {t} out of place")
        next_chunk[t] += 1
    if next_chunk != num_chunks:
        raise ValueError(f"order: chunks {next_chunk} of {num_chunks} listed")
    return order
