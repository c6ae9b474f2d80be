"""The sender's side of a torch_dist channel's rendezvous: a client of the receiver's
TCPStore, the layout and link kind under the channel's keys, the proof of the cluster secret
both ways, the receiver's verdict (its layout, whether it takes probes, the largest piece its
staging pool takes whole), then the pairwise link (`link.py`)."""

from __future__ import annotations

import itertools
import json
import uuid

import torch
import torch.distributed as dist

from duet.cluster_auth import ClusterSecret
from duet.cluster_auth.handshake import AuthenticationError, check_store_proof, store_proof
from duet.kv_transfer.layout import HandshakeError, KVLayout, checked_route
from duet.kv_transfer.torch_dist.channel import ACCEPT_QUEUE, Channel, as_timedelta
from duet.kv_transfer.torch_dist.link import link_kind, open_link


def dial(
    dest: str,
    name: str,
    layout: KVLayout,
    device: torch.device,
    *,
    emulate_nccl: bool,
    timeout_s: float,
    secret: ClusterSecret | None,
    max_piece_bytes: int,
) -> Channel:
    """A new channel to the receiver at `dest` (`host:port`) whose pieces fit both this side's
    `max_piece_bytes` and the receiver's. Raises `HandshakeError` when the receiver refused
    the layout (or this side refuses its), `AuthenticationError` when either side fails the
    secret; a store wait past `timeout_s` raises (the peer is unreachable)."""
    host, port = dest.rsplit(":", 1)
    timeout = as_timedelta(timeout_s)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    cid = f"{name}-{uuid.uuid4().hex[:12]}"
    store.set(f"{cid}/layout/sender", json.dumps(layout.to_dict()))
    store.set(f"{cid}/link/sender", link_kind(device, emulate_nccl))
    store.queue_push(ACCEPT_QUEUE, cid)
    challenge = _prove(store, cid, secret, timeout_s)
    store.wait([f"{cid}/verdict"], timeout)
    verdict = json.loads(store.get(f"{cid}/verdict"))
    if verdict.get("error") == "not authenticated":
        raise AuthenticationError(
            f"KV receiver {dest} refused this sender: it holds a different cluster secret"
        )
    if "error" in verdict:
        raise HandshakeError(f"receiver {dest} refused: {verdict['error']}")
    if secret is not None and not check_store_proof(
        secret, "receiver", cid, challenge, verdict.get("proof")
    ):
        raise AuthenticationError(f"KV receiver {dest} did not prove the cluster secret")
    peer = KVLayout.from_dict(verdict["layout"])
    route = checked_route(layout, peer)
    link = open_link(dist.PrefixStore(cid, store), 0, device, timeout_s, emulate_nccl, cid)
    # NOTE: a client of its own for the ack thread: a read from a stalled receiver's store
    # blocks (no timeout) and would hold the client's lock under `finish` and the headers.
    ack_store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    channel = Channel(cid, store, ack_store, link, peer, itertools.count(1))
    channel.probes = verdict.get("probes", False) is True
    channel.heads = route.src_slice
    # Pieces fit both sides' pools (the receiver stages each one whole).
    channel.max_piece_bytes = min(max_piece_bytes, int(verdict["max_piece_bytes"]))
    return channel


def _prove(store: dist.Store, cid: str, secret: ClusterSecret | None, timeout_s: float) -> str:
    """Answer the receiver's challenge for channel `cid` (cluster_auth/handshake.py); returns
    the challenge ("" without a secret)."""
    if secret is None:
        return ""
    store.wait([f"{cid}/challenge"], as_timedelta(timeout_s))
    challenge = store.get(f"{cid}/challenge").decode()
    store.set(f"{cid}/proof/sender", store_proof(secret, "sender", cid, challenge))
    return challenge
