"""`NixlKVSender`: the prefill side. It joins each receiver once (its agent, layout and cache
regions both ways, over the membership service), then offers each request's blocks in a NIXL
message: the receiver reads them (pull) or names its blocks for this side to write (push). See
the package's docstring for the protocol."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import grpc
import numpy as np
import torch

from duet.kv_transfer.base import KVSender, TransferResult
from duet.kv_transfer.config import SenderConfig
from duet.kv_transfer.layers import PagedLayers
from duet.kv_transfer.layout import HandshakeError, HeadRoute, KVLayout, checked_route
from duet.kv_transfer.nixl.agent import AgentLoop, Posted
from duet.kv_transfer.nixl.config import NixlSenderConfig, check_caches
from duet.kv_transfer.nixl.regions import Blocks, CacheRegions, layer_descs
from duet.kv_transfer.nixl.service import KVAgentClient
from duet.kv_transfer.nixl.windows import Window, open_at
from duet.kv_transfer.outbox import Outbox
from duet.v1 import kv_agent_pb2

logger = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 1.0  # `close` tells each receiver it leaves, waiting this long at most


@dataclass
class Channel:
    """A receiver this sender joined."""

    dest: str
    client: KVAgentClient
    peer: str  # the receiver's agent
    layout: KVLayout
    regions: CacheRegions
    route: HeadRoute  # the heads this side moves, and where they go among the receiver's
    broken: str | None = None


@dataclass
class Offer:
    """One transfer, from `send`/`begin` until the receiver is done with the blocks."""

    request_id: str
    channel: Channel
    blocks: PagedLayers
    num_layers: int  # transfer layers: the target's, then the draft's if carried
    trailer: bool  # the metadata comes after the KV (`finish`)
    layers_ready: int = 0  # in this side's blocks
    meta: dict[str, Any] | None = None
    has_meta: bool = False
    announced: int = -1  # layers the receiver was told are ready (-1: not offered yet)
    meta_sent: bool = False
    cancel_sent: bool = False
    hold_until: float = 0.0  # monotonic: the receiver may touch the blocks until then
    lease_deadline: float = float("inf")  # monotonic: its word is due by then
    # push: where the receiver wants the blocks, and what was written there
    dest: Blocks | None = None
    dest_window_end: float = 0.0
    layers_written: int = 0
    posting: bool = False
    posted: Posted | None = None
    released: bool = False  # push: every layer written; the lease on the receiver's word runs

    def ids(self) -> tuple[list[int], list[int] | None]:
        draft = self.blocks.draft_block_ids
        return self.blocks.block_ids.tolist(), draft.tolist() if draft is not None else None


class NixlKVSender(KVSender):
    config_type: ClassVar[type[SenderConfig]] = NixlSenderConfig

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        layout: KVLayout,
        config: NixlSenderConfig,
        draft_caches: list[torch.Tensor] | None = None,
    ) -> None:
        check_caches(kv_caches + (draft_caches or []))
        self.kv_caches, self.draft_caches = kv_caches, draft_caches
        self.layout = layout
        self.config = config
        self.mode = config.mode
        self.timeout_s = config.timeout_s
        self.window = Window.of_timeout(config.timeout_s)
        self.regions = CacheRegions.of_caches(kv_caches, draft_caches)
        self._lock = threading.Lock()
        self._channels: dict[str, Channel] = {}
        self._offers: dict[str, Offer] = {}  # request id -> open transfer
        self._streaming: list[Offer] = []  # begun before the current pass (engine thread)
        self._outbox = Outbox(config.ack_timeout_s)
        self.loop = AgentLoop(
            config.name, kv_caches + (draft_caches or []), self._on_message, self._on_tick,
            lambda: bool(self._offers),
        )  # fmt: skip
        self._closed = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch, name=f"kv-nixl-ping-{config.name}", daemon=True
        )
        self._watcher.start()

    # -- channels ---------------------------------------------------------------------------

    def connect(self, dest: str) -> Channel:
        """Join receiver `dest` (or reuse the channel); raises HandshakeError on a layout
        mismatch, another error when it cannot be reached within `timeout_s`."""
        with self._lock:
            channel = self._channels.get(dest)
        if channel is not None and channel.broken is None:
            return channel
        client = KVAgentClient(dest, self.config.secret, self.timeout_s)
        try:
            welcome = client.join(
                kv_agent_pb2.KVJoin(
                    agent_name=self.loop.agent_name,
                    agent_metadata=self.loop.metadata,
                    layout_json=json.dumps(self.layout.to_dict()),
                    regions_json=json.dumps(self.regions.to_dict()),
                    mode=self.mode,
                )
            )
            if welcome.error:
                raise HandshakeError(f"receiver {dest} refused: {welcome.error}")
            peer_layout = KVLayout.from_dict(json.loads(welcome.layout_json))
            route = checked_route(self.layout, peer_layout)
            # the receiver's layers this rank's stage moves (all without pipeline stages)
            regions = CacheRegions.from_dict(json.loads(welcome.regions_json)).layers(
                *self.layout.layer_range
            )

            def add() -> str:
                self.loop.drop_peer(welcome.agent_name)  # a receiver that restarted: anew
                return self.loop.add_peer(welcome.agent_metadata)

            peer = self.loop.call(add, self.timeout_s)
        except BaseException:
            client.close()
            raise
        channel = Channel(dest, client, peer, peer_layout, regions, route)
        with self._lock:
            self._channels[dest] = channel
        return channel

    def _break(self, channel: Channel, why: str) -> None:
        """The receiver is gone or forgot this sender: its transfers fail (retryable; their
        blocks stay held until the receiver's window closed), the next send joins again."""
        with self._lock:
            if channel.broken is not None:
                return
            channel.broken = why
            if self._channels.get(channel.dest) is channel:
                del self._channels[channel.dest]
            offers = [o for o in self._offers.values() if o.channel is channel]
        logger.warning("KV channel to %s lost: %s", channel.dest, why)
        for offer in offers:
            self._outbox.fail(offer.request_id, f"receiver {channel.dest}: {why}")
        self.loop.submit(lambda: self.loop.drop_peer(channel.peer))

    def _watch(self) -> None:
        """Ping the receivers of open transfers: a dead or silent one fails them within the
        timeout rather than at the lease."""
        interval = min(1.0, self.timeout_s / 4)
        while not self._closed.wait(interval):
            with self._lock:
                channels = {id(o.channel): o.channel for o in self._offers.values()}
            for channel in channels.values():
                if channel.broken is not None:
                    continue
                try:
                    known = channel.client.ping(self.loop.agent_name)
                except grpc.RpcError as e:  # unreachable, or no answer in time
                    self._break(channel, f"no answer to a ping: {e.code()}")
                    continue
                if not known:
                    self._break(channel, "the receiver no longer knows this sender")

    # -- worker side (the engine thread) ----------------------------------------------------

    def send(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        meta: dict[str, Any] | None = None,
        draft_block_ids: list[int] | None = None,
    ) -> None:
        offer = self._open(request_id, block_ids, dest, False, draft_block_ids)
        if offer is not None:
            offer.layers_ready, offer.meta, offer.has_meta = offer.num_layers, meta, True
            self._admit(offer)

    def begin(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        draft_block_ids: list[int] | None = None,
    ) -> bool:
        offer = self._open(request_id, block_ids, dest, True, draft_block_ids)
        if offer is not None:
            self._streaming.append(offer)
            self._admit(offer)
        return True

    def layer_computed(self, layer: int) -> None:
        streaming = self._streaming
        if layer == len(self.kv_caches) - 1:
            self._streaming = []
        for offer in streaming:
            # the draft's layers (after the target's) were computed before the pass
            offer.layers_ready = offer.num_layers if layer == len(self.kv_caches) - 1 else layer + 1
        if streaming:
            self.loop.submit(_nothing)  # wake the loop: it tells the receivers

    def finish(self, request_id: str, meta: dict[str, Any] | None = None) -> None:
        with self._lock:
            offer = self._offers.get(request_id)
        if offer is not None:
            offer.meta, offer.has_meta = meta or {}, True
            self.loop.submit(_nothing)

    def abort(self, request_id: str) -> None:
        """Reported ABORTED once the receiver let go of the blocks (or its window closed)."""
        self._outbox.abort(request_id)
        self.loop.submit(_nothing)

    def _open(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        trailer: bool,
        draft_block_ids: list[int] | None,
    ) -> Offer | None:
        blocks = PagedLayers.of_ids(self.kv_caches, block_ids, self.draft_caches, draft_block_ids)
        channel = self._outbox.reach(request_id, dest, self.connect)
        if channel is None:
            return None
        self._outbox.open(request_id, channel, dest=dest)
        return Offer(request_id, channel, blocks, blocks.num_layers, trailer)

    def _admit(self, offer: Offer) -> None:
        with self._lock:
            self._offers[offer.request_id] = offer
        self.loop.submit(_nothing)

    # -- scheduler side (the engine thread) -------------------------------------------------

    def poll(self) -> list[TransferResult]:
        return self._outbox.poll()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:  # the receiver drops this agent now rather than at a timeout
            try:
                channel.client.leave(self.loop.agent_name, LEAVE_TIMEOUT_S)
            except Exception as e:
                logger.info("KV receiver %s did not hear this sender leave: %s", channel.dest, e)
            channel.client.close()
        self._watcher.join(self.timeout_s)
        self.loop.close()

    # -- the agent's thread -----------------------------------------------------------------

    def _on_message(self, agent: str, message: dict[str, Any]) -> None:
        kind, request_id = message.get("t"), str(message.get("id", ""))
        with self._lock:
            offer = self._offers.get(request_id)
        if offer is None or offer.channel.peer != agent:
            return  # over already
        if kind == "done":
            self._outbox.acknowledge(request_id)
            self._let_go(offer)
        elif kind in ("refuse", "stop"):
            self._outbox.fail(request_id, f"the receiver refused: {message.get('error')}")
            if kind == "stop":
                if offer.posted is not None:
                    self.loop.cancel(offer.posted, "the receiver stopped it")
                self._notify(offer, {"t": "stopped", "id": request_id})
            self._let_go(offer)
        elif kind == "dest" and self.mode == "push":
            draft = message.get("draft_blocks")
            offer.dest = Blocks(
                offer.channel.regions, np.asarray(message["blocks"], dtype=np.int64),
                np.asarray(draft, dtype=np.int64) if draft is not None else None,
                offer.channel.route.dst[0], offer.channel.route.num_heads,
            )  # fmt: skip
            offer.dest_window_end = float(message["window_end"])
        else:
            logger.warning("KV message %r from %s: unexpected", kind, agent)

    def _on_tick(self) -> None:
        with self._lock:
            offers = list(self._offers.values())
        now = time.monotonic()
        for offer in offers:
            if self._outbox.decided(offer.request_id):
                self._wind_down(offer, now)
            elif offer.channel.broken is not None:
                self._outbox.fail(offer.request_id, offer.channel.broken)
            else:
                self._announce(offer, now)
                if self.mode == "push":
                    self._write(offer)

    def _announce(self, offer: Offer, now: float) -> None:
        """Tell the receiver what is new: the offer, layers computed since, the trailer."""
        ready = offer.layers_ready  # NOTE: once; the engine thread raises it meanwhile
        if offer.announced < 0:
            block_ids, draft_ids = offer.ids()
            message: dict[str, Any] | None = {
                "t": "offer", "id": offer.request_id, "mode": self.mode, "blocks": block_ids,
                "draft_blocks": draft_ids, "num_layers": offer.num_layers,
                "layers": ready, "window_end": self.window.end(),
                "trailer": offer.trailer, "meta": offer.meta if not offer.trailer else None,
            }  # fmt: skip
        elif ready > offer.announced:
            message = {"t": "ready", "id": offer.request_id, "layers": ready,
                       "window_end": self.window.end()}  # fmt: skip
        else:
            message = None
        if message is not None:
            offer.announced = ready
            offer.hold_until = self.window.hold_until()
            if not self._notify(offer, message):
                return
            if ready > 0 and self.mode == "pull":  # layers the receiver may read now
                self._outbox.sent_chunk(offer.request_id)
        if offer.trailer and offer.has_meta and not offer.meta_sent:
            offer.meta_sent = self._notify(
                offer, {"t": "meta", "id": offer.request_id, "meta": offer.meta}
            )
        if offer.announced == offer.num_layers and (offer.meta_sent or not offer.trailer):
            if offer.lease_deadline == float("inf"):  # push: the outbox's lease, from the write
                offer.lease_deadline = now + self.config.ack_timeout_s
            elif self.mode == "pull" and now >= offer.lease_deadline:
                self._outbox.fail(offer.request_id, "no acknowledgement")

    def _wind_down(self, offer: Offer, now: float) -> None:
        """A decided transfer (aborted, failed): tell the receiver once, and let go of the
        blocks when it confirmed, or when its window on them closed."""
        if not offer.cancel_sent and offer.announced >= 0 and offer.channel.broken is None:
            offer.cancel_sent = True
            self._notify(offer, {"t": "cancel", "id": offer.request_id, "error": "aborted"})
        if offer.posting or offer.posted is not None:
            return  # push: this side's write ends first
        if self.mode == "push" or offer.announced < 0 or now >= offer.hold_until:
            self._let_go(offer)

    def _write(self, offer: Offer) -> None:
        """Push: write layers computed since the last write into the receiver's blocks."""
        dest = offer.dest
        if dest is None or offer.posting or offer.posted is not None:
            return
        ready = offer.layers_ready
        end = ready
        if dest.draft_block_ids is None:  # the receiver reserved nothing for the draft
            end = min(end, self.layout.num_local_layers)
        whole = ready == offer.num_layers
        if offer.layers_written >= end:
            if offer.layers_written == self.layout.num_local_layers and whole:
                offer.layers_written = offer.num_layers  # the draft's: not wanted there
            done = offer.layers_written == offer.num_layers
            if done and (offer.meta_sent or not offer.trailer) and not offer.released:
                offer.released = True
                self._outbox.release(offer.request_id)  # the lease on the receiver's word runs
            return
        if not open_at(offer.dest_window_end):
            self._outbox.fail(offer.request_id, "the receiver's window closed before the write")
            return
        start = offer.layers_written
        block_ids, draft_ids = offer.ids()
        route = offer.channel.route
        local = Blocks(
            self.regions, np.asarray(block_ids, dtype=np.int64),
            np.asarray(draft_ids, dtype=np.int64) if draft_ids is not None else None,
            route.src[0], route.num_heads,
        )  # fmt: skip
        local_descs, remote_descs = layer_descs(local, dest, start, end)
        # the receiver counts the draft's layers it reserved nothing for as written
        written = offer.num_layers if end == self.layout.num_local_layers and whole else end

        def on_end(why: str | None) -> None:
            offer.posted = None
            if why is None:
                offer.layers_written = max(offer.layers_written, end)
                self._outbox.sent_chunk(offer.request_id)
            else:
                self._outbox.fail(offer.request_id, why)

        offer.posting = True
        posted = self.loop.post(
            "WRITE", local_descs, remote_descs, offer.channel.peer,
            (self.regions.mem_type, dest.regions.mem_type), self.window.run_s, on_end,
            {"t": "written", "id": offer.request_id, "layers": written},
        )  # fmt: skip
        offer.posting = False
        if posted is not None and offer.layers_written < end:
            offer.posted = posted

    def _let_go(self, offer: Offer) -> None:
        """The receiver no longer touches the blocks: `poll` may report the transfer."""
        with self._lock:
            self._offers.pop(offer.request_id, None)
        self._outbox.release(offer.request_id)

    def _notify(self, offer: Offer, message: dict[str, Any]) -> bool:
        try:
            self.loop.notify(offer.channel.peer, message)
            return True
        except Exception as e:
            self._break(offer.channel, f"message failed: {e}")
            return False


def _nothing() -> None:
    """A job that only wakes the agent's loop."""
