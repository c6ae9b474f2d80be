"""A torch_dist channel: the store keys both sides use, and the 2-rank group a channel's
tensors go over."""

from __future__ import annotations

import datetime
import itertools
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kv_transfer.layout import KVLayout

logger = logging.getLogger(__name__)

ACCEPT_QUEUE = "duet/kv/accept"
IDLE_POP_S = 300.0  # a receiver thread's blocking wait for the next channel or transfer


@dataclass
class Channel:
    cid: str
    store: dist.Store
    group: Any  # a 2-rank gloo or NCCL group (the stubs lack send/recv)
    peer_layout: KVLayout
    tags: itertools.count[int]


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


def pair_group(store: dist.Store, rank: int, device: torch.device, timeout_s: float) -> Any:
    """A 2-rank process group for one channel: NCCL between CUDA caches, else gloo."""
    if device.type == "cuda":
        # NOTE: not exercised in CI (no GPU there); the gloo path is.
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = as_timedelta(timeout_s)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, as_timedelta(timeout_s))
