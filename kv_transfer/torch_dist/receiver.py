"""`TorchDistKVReceiver`: hosts the rendezvous store, a thread per channel posting the
receives of each header's chunks into staging buffers, and the inbox (`InboxKVReceiver`) the
engine thread polls (see the package's docstring)."""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections import deque
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from duet.cluster_auth.handshake import check_store_proof, store_challenge, store_proof
from duet.cluster_auth.refusals import RefusalLog
from duet.engine.device import bind_thread
from duet.engine.rendezvous import listening_store
from duet.kv_transfer.chunks import Piece
from duet.kv_transfer.config import ReceiverConfig
from duet.kv_transfer.inbox import Arrival, InboxKVReceiver
from duet.kv_transfer.layers import staged_shape
from duet.kv_transfer.layout import HandshakeError, KVLayout, checked_route
from duet.kv_transfer.staging import StagingPool
from duet.kv_transfer.torch_dist.channel import (
    ACCEPT_QUEUE,
    IDLE_POP_S,
    ack_key,
    as_timedelta,
    check_emulation,
    check_link,
    meta_key,
    sender_order,
)
from duet.kv_transfer.torch_dist.config import TorchDistReceiverConfig
from duet.kv_transfer.torch_dist.link import (
    LinkEvent,
    PairLink,
    link_kind,
    open_link,
    set_nccl_error_handling,
)
from duet.kv_transfer.torch_dist.probe import probe_scratch
from duet.kv_transfer.torch_dist.relay import StoreRelay

logger = logging.getLogger(__name__)


class TorchDistKVReceiver(InboxKVReceiver):
    config_type: ClassVar[type[ReceiverConfig]] = TorchDistReceiverConfig

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        layout: KVLayout,
        config: TorchDistReceiverConfig,
        draft_caches: list[torch.Tensor] | None = None,
    ) -> None:
        """Host the store on `config.host:port` (0: a free port). `address` is what senders
        dial: `advertise_host` (default `host`) and the bound port."""
        super().__init__(kv_caches, layout, config.timeout_s, draft_caches)
        set_nccl_error_handling()  # before any link's NCCL group is built
        self.config = config
        self.timeout_s = config.timeout_s
        self.emulate_nccl = config.emulate_nccl
        check_emulation(kv_caches[0].device, config.emulate_nccl)
        self._staging = StagingPool(kv_caches[0].device, config.staging_bytes)
        # On `config.host` only (c10d's own server would listen on every interface).
        self.store = listening_store(config.host, config.port, None, config.timeout_s)
        self._address = f"{config.advertise_host or config.host}:{self.store.port}"
        self._relay = StoreRelay(config.name, config.timeout_s)
        self._closed = threading.Event()
        self.refusals = RefusalLog(f"KV receiver {config.name}")
        self._links: dict[str, PairLink] = {}  # the channels being served (tests hold them)
        self._channel_ids: list[str] = []  # channels opened to us (close() wakes their threads)
        self._threads = [threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)]
        self._threads[0].start()

    @property
    def address(self) -> str:
        return self._address

    def _client(self, timeout_s: float) -> dist.TCPStore:
        host = self.store.host
        if host in ("0.0.0.0", "::", ""):  # bound to every interface: reach it on loopback
            host = "::1" if host == "::" else "127.0.0.1"
        return dist.TCPStore(
            host, self.store.port, is_master=False, timeout=as_timedelta(timeout_s)
        )

    def _accept_loop(self) -> None:
        # A client of our own store: blocking pops on the master object would hold its lock.
        # Pops block for long (each timeout logs a c10d warning); `close` wakes them by pushing
        # an empty entry.
        client = self._client(IDLE_POP_S)
        while not self._closed.is_set():
            try:
                cid = client.queue_pop(ACCEPT_QUEUE, block=True).decode()
            except Exception:
                continue  # store timeout: look at _closed again
            if not cid or self._closed.is_set():
                continue  # close() woke us
            with self._lock:
                self._channel_ids.append(cid)
            thread = threading.Thread(
                target=self._serve_channel, args=(cid,), name=f"kv-recv-{cid}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _serve_channel(self, cid: str) -> None:
        bind_thread(self.kv_caches[0].device)
        store = self._client(self.timeout_s)
        proof = self._authenticate(cid, store)
        if proof is None:
            return
        sender = KVLayout.from_dict(json.loads(store.get(f"{cid}/layout/sender")))
        device = self.kv_caches[0].device
        kind = link_kind(device, self.emulate_nccl)
        try:
            checked_route(sender, self.layout)
            check_link(store.get(f"{cid}/link/sender").decode(), kind)
        except HandshakeError as e:
            logger.error("refusing KV channel %s: %s", cid, e)
            store.set(f"{cid}/verdict", json.dumps({"error": str(e)}))
            return
        verdict = {
            "layout": self.layout.to_dict(),
            "proof": proof,
            "probes": True,
            "max_piece_bytes": self._staging.max_piece_bytes,
        }
        store.set(f"{cid}/verdict", json.dumps(verdict))
        link = open_link(
            dist.PrefixStore(cid, store), 1, device, self.timeout_s, self.emulate_nccl, cid
        )
        logger.info("KV channel %s open over %s", cid, link.kind)
        with self._lock:
            self._links[cid] = link
        headers = self._client(IDLE_POP_S)
        try:
            while not self._closed.is_set():
                try:
                    raw = headers.queue_pop(f"{cid}/xfers", block=True)
                except Exception:
                    continue  # idle channel
                if not raw:
                    continue  # close() woke us
                header = json.loads(raw)
                if "probe" in header:
                    if not self._drop_probe(cid, link, header["probe"]):
                        return
                elif not self._receive(cid, store, link, sender, header):
                    return
        finally:
            link.close()
            with self._lock:
                del self._links[cid]

    def _authenticate(self, cid: str, store: dist.Store) -> str | None:
        """The channel's sender proves the cluster secret against a fresh challenge before
        anything it wrote is read: the receiver's proof back, or None (refused: the verdict
        says so, no link is opened). Without a secret: "" (no proofs)."""
        secret = self.config.secret
        if secret is None:
            return ""
        challenge = store_challenge()
        store.set(f"{cid}/challenge", challenge)
        try:
            store.wait([f"{cid}/proof/sender"], as_timedelta(self.timeout_s))
            proof = store.get(f"{cid}/proof/sender").decode(errors="replace")
        except Exception as e:  # the store's timeout: no answer
            reason = f"no proof of the cluster secret: {e}"
        else:
            if check_store_proof(secret, "sender", cid, challenge, proof):
                return store_proof(secret, "receiver", cid, challenge)
            reason = "the sender did not prove the cluster secret"
        # NOTE: the store does not know the peer's address: the channel id names the sender
        self.refusals.refused(f"channel {cid.rsplit('-', 1)[0]}", reason)
        store.set(f"{cid}/verdict", json.dumps({"error": "not authenticated"}))
        return None

    def _receive(
        self,
        cid: str,
        store: dist.Store,
        link: PairLink,
        sender: KVLayout,
        header: dict[str, Any],
    ) -> bool:
        """Receive the transfers of one header, piece by piece through the staging pool; False
        when the channel is lost (its link aborted, its unfinished requests failed)."""
        transfers = header["transfers"]
        dtype = self.kv_caches[0].dtype
        posted: list[tuple[str, Arrival]] = []
        num_landed = [0] * len(transfers)
        waiting: deque[tuple[int, Piece, torch.Tensor, LinkEvent]] = deque()  # posted receives

        def land(block: bool) -> bool:
            """Hand the first posted receive to the inbox once its event says it landed (its
            slot is the inbox's from then on); False when it has not yet (`block`: after
            `timeout_s`, TimeoutError)."""
            t, piece, data, event = waiting[0]
            if not (event.wait(self.timeout_s) if block else event.query()):
                if block:
                    raise TimeoutError(f"no KV arrived for {self.timeout_s:g}s")
                return False
            waiting.popleft()
            self.progress(posted[t][1], piece, data, functools.partial(self._give, data))
            num_landed[t] += 1
            return True

        try:
            for transfer in transfers:
                request_id = transfer["request_id"]
                shape = staged_shape(transfer["shape"], transfer.get("draft_shape"), dtype)
                arrival = Arrival(
                    shape,
                    sender,
                    transfer["meta"],
                    functools.partial(self._relay.acknowledge, store, ack_key(cid, request_id)),
                    time.monotonic(),
                )
                if transfer["trailer"]:
                    self._await_trailer(arrival, store, meta_key(cid, request_id))
                posted.append((request_id, arrival))
                self.deliver(request_id, arrival)
            # NOTE: in exactly the sender's order (layer-first across the requests of a pass):
            # NCCL matches messages by issue order, not by tag.
            for t, k in sender_order(header):
                start, end, first, last, tag = transfers[t]["chunks"][k]
                piece = (start, end, first, last)
                slot_shape = posted[t][1].shape.piece_shape(piece)
                # the inbox frees slots as it writes what landed: hand it what has meanwhile
                data = self._staging.take(
                    slot_shape, dtype, self.timeout_s, between=lambda: bool(waiting) and land(False)
                )
                try:
                    link.recv(data, tag)
                except BaseException:
                    self._staging.give(data)
                    raise
                waiting.append((t, piece, data, link.record()))
            while waiting:  # each within the timeout
                land(block=True)
        except Exception as e:  # the sender died or stalled mid-transfer: this channel is done
            logger.warning("KV channel %s lost: %s", cid, e)
            link.abort()  # NOTE: before the slots go back: nothing lands after it returns
            for _, _, data, _ in waiting:
                self._staging.give(data)
            for t, (request_id, _) in enumerate(posted):
                if num_landed[t] < len(transfers[t]["chunks"]):
                    self.fail(request_id, f"sender lost: {e}")
            return False
        return True

    def _give(self, data: torch.Tensor) -> None:
        """The inbox wrote a piece (or dropped it): its slot back, after the engine thread's
        queued reads of it on CUDA."""
        self._staging.give_after_reads(data)

    def _drop_probe(self, cid: str, link: PairLink, probe: dict[str, Any]) -> bool:
        """Take a link probe's bursts (probe.py) in the channel's order into a scratch buffer
        and drop them; False when the channel is lost."""
        try:
            scratch, tags = probe_scratch(probe, self.kv_caches[0].device)
            for tag in tags:
                link.recv(scratch, tag)
            if not link.record().wait(self.timeout_s):
                raise TimeoutError(f"no link probe arrived for {self.timeout_s:g}s")
        except Exception as e:
            logger.warning("KV channel %s lost in a link probe: %s", cid, e)
            link.abort()
            return False
        return True

    def _await_trailer(self, arrival: Arrival, store: dist.Store, key: str) -> None:
        """The relay's thread fetches the trailer; `poll` only looks at what it found."""
        trailer = self._relay.await_trailer(store, key)
        arrival.fetch_meta = lambda: trailer.meta
        # the inbox is done with the arrival: stop looking
        arrival.release = functools.partial(self._relay.forget, key)

    def close(self) -> None:
        """Stop the accept and channel threads (woken by an empty queue entry) and wait for them:
        c10d objects must not be torn down under a thread still blocked in them."""
        self._closed.set()
        with self._lock:
            channel_ids = list(self._channel_ids)
            links = list(self._links.values())
        for link in links:  # wakes a channel thread waiting for data
            link.close()
        try:
            self.store.queue_push(ACCEPT_QUEUE, b"")
            for cid in channel_ids:
                self.store.queue_push(f"{cid}/xfers", b"")
        except Exception as e:  # the threads still wake at their pop timeout
            logger.warning("could not wake the KV receiver's threads: %s", e)
        for thread in list(self._threads):
            thread.join(timeout=self.timeout_s)
        self._relay.close()
