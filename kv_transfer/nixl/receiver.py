"""`NixlKVReceiver`: the decode side. Senders join through its membership service; their offers
come as NIXL messages; once a request is both offered and expected, its blocks move straight
between the two caches: read by this side's agent (pull), or written by the sender into the
blocks this side names (push). See the package's docstring for the protocol."""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from duet.kv_transfer.base import KVReceiver, TransferResult, TransferStatus
from duet.kv_transfer.config import ReceiverConfig
from duet.kv_transfer.layout import HandshakeError, HeadRoute, KVLayout, checked_route, num_senders
from duet.kv_transfer.nixl.agent import AgentLoop, Posted
from duet.kv_transfer.nixl.config import NixlReceiverConfig, check_caches
from duet.kv_transfer.nixl.regions import Blocks, CacheRegions, layer_descs
from duet.kv_transfer.nixl.service import KVAgentServer
from duet.kv_transfer.nixl.windows import Window, open_at
from duet.v1 import kv_agent_pb2

logger = logging.getLogger(__name__)

ABORT_WAIT_S = 2.0
"""`abort` waits this long at most for an operation on the request's blocks to end (a push
sender's confirmation that it stopped writing included)."""


@dataclass
class Peer:
    """A sender's agent that joined."""

    name: str
    layout: KVLayout
    regions: CacheRegions
    route: HeadRoute  # the heads it moves, and where they go among this side's


@dataclass
class Shard:
    """One sender rank's offer of one request."""

    peer: Peer
    mode: str
    block_ids: np.ndarray  # the sender's
    draft_block_ids: np.ndarray | None
    num_layers: int  # transfer layers it carries: the target's, then the draft's if any
    layers_ready: int  # [0, layers_ready) are in the sender's blocks
    window_end: float  # pull: the sender's window on its blocks (wall clock)
    meta: dict[str, Any] | None
    has_meta: bool  # False until a layer-wise sender's trailer came
    layers_done: int = 0  # in the reserved blocks (read here, or written by the sender)
    posting: bool = False  # this side's thread is posting a read of it
    posted: Posted | None = None
    dest_window_end: float = 0.0  # push: the window this side gave on its blocks (0: not yet)
    dest_hold_end: float = 0.0  # push: wall clock after which no write of the sender's can run
    stopped: bool = False  # push: the sender confirmed it writes no more

    @property
    def complete(self) -> bool:
        return self.layers_done == self.num_layers and self.has_meta

    @property
    def moving(self) -> bool:
        """An operation on the reserved blocks may be running (this side's read, or, push, the
        sender's writes under a window that is still open)."""
        if self.posting or self.posted is not None:
            return True
        return (
            self.mode == "push"
            and self.dest_window_end > 0
            and not self.stopped
            and not self.complete
            and time.time() < self.dest_hold_end
        )


@dataclass
class Pending:
    """A request this side expects, or was offered, or both."""

    expected: tuple[list[int], float, list[int] | None] | None = None  # ids, deadline, draft ids
    shards: dict[str, Shard] = field(default_factory=dict)  # by sender agent
    since: float = field(default_factory=time.monotonic)  # first offer: stale after a while
    outcome: TransferResult | None = None  # decided; reported once nothing moves any more


class NixlKVReceiver(KVReceiver):
    config_type: ClassVar[type[ReceiverConfig]] = NixlReceiverConfig

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        layout: KVLayout,
        config: NixlReceiverConfig,
        draft_caches: list[torch.Tensor] | None = None,
    ) -> None:
        check_caches(kv_caches + (draft_caches or []))
        self.kv_caches, self.draft_caches = kv_caches, draft_caches
        self.layout = layout
        self.config = config
        self.timeout_s = config.timeout_s
        self.window = Window.of_timeout(config.timeout_s)
        self.regions = CacheRegions.of_caches(kv_caches, draft_caches)
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # an operation on some blocks ended
        self._peers: dict[str, Peer] = {}
        self._pending: dict[str, Pending] = {}
        self._aborted: dict[str, float] = {}  # request id -> when: later offers are refused
        self._results: list[TransferResult] = []
        self._replies: list[tuple[str, dict[str, Any]]] = []  # messages to send, loop thread
        self.loop = AgentLoop(
            config.name, kv_caches + (draft_caches or []), self._on_message, self._on_tick,
            lambda: bool(self._pending),
        )  # fmt: skip
        try:
            self._server = KVAgentServer(
                config.host, config.port, config.secret, self._join, self._leave, self._ping,
                config.timeout_s,
            )  # fmt: skip
        except BaseException:
            self.loop.close()
            raise
        shown = config.advertise_host or config.host
        port = self._server.port
        self._address = f"[{shown}]:{port}" if ":" in shown else f"{shown}:{port}"

    @property
    def address(self) -> str:
        return self._address

    @property
    def peers(self) -> list[str]:
        """The agents of the senders that joined and have not left."""
        with self._lock:
            return sorted(self._peers)

    # -- membership (the service's threads) ------------------------------------------------

    def _join(self, request: kv_agent_pb2.KVJoin) -> kv_agent_pb2.KVWelcome:
        try:
            sender = KVLayout.from_dict(json.loads(request.layout_json))
            route = checked_route(sender, self.layout)
            regions = CacheRegions.from_dict(json.loads(request.regions_json))
        except (HandshakeError, ValueError, KeyError, TypeError) as e:
            logger.error("refusing KV agent %s: %s", request.agent_name, e)
            return kv_agent_pb2.KVWelcome(error=str(e))

        def add() -> str:
            if request.agent_name in self._peers:  # a sender that rejoins: a fresh start
                self.loop.drop_peer(request.agent_name)
            return self.loop.add_peer(request.agent_metadata)

        name = self.loop.call(add, self.timeout_s)
        if name != request.agent_name:
            return kv_agent_pb2.KVWelcome(error=f"agent metadata names {name!r}")
        with self._lock:
            self._peers[name] = Peer(name, sender, regions, route)
        logger.info("KV agent %s joined %s", name, self.config.name)
        return kv_agent_pb2.KVWelcome(
            agent_name=self.loop.agent_name,
            agent_metadata=self.loop.metadata,
            layout_json=json.dumps(self.layout.to_dict()),
            regions_json=json.dumps(self.regions.to_dict()),
        )

    def _leave(self, agent_name: str) -> None:
        self.loop.call(lambda: self._drop_peer(agent_name, "the sender left"), self.timeout_s)

    def _ping(self, agent_name: str) -> bool:
        with self._lock:
            return agent_name in self._peers

    def _drop_peer(self, agent_name: str, why: str) -> None:
        """(Loop thread.) Forget a sender: its requests fail (retryable), its agent goes."""
        with self._lock:
            if self._peers.pop(agent_name, None) is None:
                return
            for request_id, pending in self._pending.items():
                if agent_name in pending.shards:
                    self._fail(request_id, pending, why)
        self.loop.drop_peer(agent_name)  # ends its reads in flight (their on_end: failed)
        logger.info("KV agent %s left %s: %s", agent_name, self.config.name, why)

    # -- scheduler side (the engine thread) -------------------------------------------------

    def expect(
        self,
        request_id: str,
        block_ids: list[int],
        timeout_s: float,
        draft_block_ids: list[int] | None = None,
    ) -> None:
        if draft_block_ids is not None and self.draft_caches is None:
            raise ValueError("draft_block_ids: this receiver has no draft caches")
        num_blocks = self.kv_caches[0].shape[1]
        bad = [b for b in block_ids if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"block_ids: {bad[0]} is not in [0, {num_blocks})")
        draft = list(draft_block_ids) if draft_block_ids is not None else None
        with self._lock:
            pending = self._pending.setdefault(request_id, Pending())
            pending.expected = (list(block_ids), time.monotonic() + timeout_s, draft)

    def abort(self, request_id: str) -> None:
        """Returns once no operation on the request's blocks runs (at most `ABORT_WAIT_S`:
        then it logs that one may still)."""
        with self._settled:
            self._aborted[request_id] = time.monotonic()
            pending = self._pending.get(request_id)
            if pending is None:
                return
            if pending.expected is not None:  # not reported yet
                self._results.append(TransferResult(request_id, TransferStatus.ABORTED))
            pending.expected = None
            pending.outcome = TransferResult(request_id, TransferStatus.ABORTED)
            for shard in pending.shards.values():
                self._refuse(request_id, shard, "aborted by the receiver")
            deadline = time.monotonic() + ABORT_WAIT_S
            while any(s.moving for s in pending.shards.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning("KV of aborted %s may still be moving", request_id)
                    break
                self._settled.wait(min(left, 0.01))

    def poll(self) -> list[TransferResult]:
        with self._lock:
            out, self._results = self._results, []
        return out

    def close(self) -> None:
        self._server.close()
        self.loop.close()

    # -- the agent's thread -----------------------------------------------------------------

    def _on_message(self, agent: str, message: dict[str, Any]) -> None:
        kind, request_id = message.get("t"), str(message.get("id", ""))
        with self._lock:
            peer = self._peers.get(agent)
            if peer is None:
                logger.warning("KV message from %s, which never joined: dropped", agent)
                return
            pending = self._pending.get(request_id)
            shard = pending.shards.get(agent) if pending is not None else None
            if kind == "offer":
                self._offer(request_id, peer, message)
            elif shard is None or pending is None:
                return  # for a request already over (refused, failed, aborted)
            elif kind == "ready":
                shard.layers_ready = max(shard.layers_ready, int(message["layers"]))
                shard.window_end = float(message["window_end"])
            elif kind == "meta":
                shard.meta, shard.has_meta = message.get("meta") or {}, True
            elif kind == "written":
                shard.layers_done = max(shard.layers_done, int(message["layers"]))
            elif kind == "stopped":
                shard.stopped = True
                self._settled.notify_all()
            elif kind == "cancel":
                self._fail(request_id, pending, f"the sender gave up: {message.get('error')}")
            else:
                logger.warning("KV message %r from %s: unknown", kind, agent)

    def _offer(self, request_id: str, peer: Peer, message: dict[str, Any]) -> None:
        """(Under the lock.) A sender's offer: kept until expected (or stale)."""
        num_blocks, num_layers = len(message["blocks"]), int(message["num_layers"])
        draft = message.get("draft_blocks")
        target_layers = peer.layout.num_local_layers  # its pipeline stage's layers
        if (
            request_id in self._aborted
            or not 1 <= num_blocks <= peer.regions.target.num_blocks
            or num_layers not in (target_layers, target_layers + len(self.draft_caches or []))
            or (num_layers > target_layers) != (draft is not None)
        ):
            why = "aborted by the receiver" if request_id in self._aborted else "a bad offer"
            self._replies.append((peer.name, {"t": "refuse", "id": request_id, "error": why}))
            return
        pending = self._pending.setdefault(request_id, Pending())
        if pending.outcome is not None:
            self._replies.append((peer.name, {"t": "refuse", "id": request_id, "error": "over"}))
            return
        pending.shards[peer.name] = Shard(
            peer, str(message.get("mode", "pull")),
            np.asarray(message["blocks"], dtype=np.int64),
            np.asarray(draft, dtype=np.int64) if draft is not None else None,
            num_layers, int(message["layers"]), float(message["window_end"]),
            message.get("meta"), not message.get("trailer", False),
        )  # fmt: skip

    def _on_tick(self) -> None:
        reads: list[tuple[str, Shard, int]] = []
        with self._lock:
            self._settle(reads)
            replies, self._replies = self._replies, []
        for agent, message in replies:
            self._send(agent, message)
        for request_id, shard, end in reads:
            self._read(request_id, shard, end)

    def _settle(self, reads: list[tuple[str, Shard, int]]) -> None:
        """(Under the lock.) Move every pending request along: reads to post, destinations to
        hand out, completions, failures, stale offers."""
        now = time.monotonic()
        for request_id, since in list(self._aborted.items()):
            if now - since > 2 * self.timeout_s:  # its offers were refused long since
                del self._aborted[request_id]
        for request_id, pending in list(self._pending.items()):
            moving = any(s.moving for s in pending.shards.values())
            if pending.outcome is not None:
                if not moving:  # decided, and nothing touches the blocks any more
                    del self._pending[request_id]
                    if pending.outcome.status != TransferStatus.ABORTED:
                        self._results.append(pending.outcome)
                continue
            if pending.expected is None:
                if now - pending.since > self.timeout_s:  # offered, never expected
                    for shard in pending.shards.values():
                        self._refuse(request_id, shard, "not expected in time")
                    del self._pending[request_id]
                continue
            deadline = pending.expected[1]
            for shard in pending.shards.values():
                self._advance(request_id, pending, shard, reads)
            shards = pending.shards.values()
            if pending.outcome is None and len(shards) >= self._num_shards(pending):
                if all(s.complete for s in shards):
                    self._done(request_id, pending)
                    continue
            if pending.outcome is None and now >= deadline:
                self._fail(request_id, pending, "timed out waiting for KV")

    def _advance(
        self, request_id: str, pending: Pending, shard: Shard, reads: list[tuple[str, Shard, int]]
    ) -> None:
        assert pending.expected is not None
        block_ids, _, draft_ids = pending.expected
        if len(block_ids) < len(shard.block_ids):
            self._fail(request_id, pending, "more blocks offered than reserved")
            return
        waiting = shard.layers_ready < shard.num_layers or not shard.has_meta
        if waiting and shard.layers_done >= shard.layers_ready and not open_at(shard.window_end):
            # NOTE: a sender renews its window with every layer it announces: one silent for a
            # whole window with layers (or the trailer) still to come is dead or stopped.
            self._fail(request_id, pending, "the sender went silent mid-transfer")
            return
        if shard.mode == "push":
            if shard.dest_window_end == 0:
                shard.dest_window_end = self.window.end()
                shard.dest_hold_end = (
                    shard.dest_window_end + self.window.hold_s - self.window.start_s
                )
                n = len(shard.block_ids)
                carried = draft_ids[:n] if draft_ids is not None else None
                self._replies.append((shard.peer.name, {
                    "t": "dest", "id": request_id, "blocks": block_ids[:n],
                    "draft_blocks": carried if shard.draft_block_ids is not None else None,
                    "window_end": shard.dest_window_end,
                }))  # fmt: skip
            elif not shard.complete and not open_at(shard.dest_window_end + self.window.run_s):
                self._fail(request_id, pending, "the sender did not write within its window")
            return
        if shard.posting or shard.posted is not None or shard.layers_done >= shard.layers_ready:
            return
        readable = shard.layers_ready
        if draft_ids is None or shard.draft_block_ids is None:  # draft layers: dropped
            readable = min(readable, shard.peer.layout.num_local_layers)
        if shard.layers_done >= readable:
            shard.layers_done = shard.layers_ready  # nothing here to read
        elif not open_at(shard.window_end):
            self._fail(request_id, pending, "the sender's window closed before its KV was read")
        else:
            shard.posting = True
            reads.append((request_id, shard, readable))

    def _read(self, request_id: str, shard: Shard, end: int) -> None:
        """(Loop thread, not under the lock.) Read layers [done, end) of a shard."""
        with self._lock:
            pending = self._pending.get(request_id)
            live = pending is not None and pending.outcome is None
            expected = pending.expected if pending is not None and live else None
        start = shard.layers_done
        posted = None
        if expected is not None:
            block_ids, _, draft_ids = expected
            n = len(shard.block_ids)
            local = Blocks(
                self.regions.layers(*shard.peer.layout.layer_range),
                np.asarray(block_ids[:n], dtype=np.int64),
                np.asarray(draft_ids[:n], dtype=np.int64) if draft_ids is not None else None,
                shard.peer.route.dst[0], shard.peer.route.num_heads,
            )  # fmt: skip
            remote = Blocks(
                shard.peer.regions, shard.block_ids, shard.draft_block_ids,
                shard.peer.route.src[0], shard.peer.route.num_heads,
            )  # fmt: skip

            def on_end(why: str | None) -> None:
                self._read_ended(request_id, shard, end, why)

            local_descs, remote_descs = layer_descs(local, remote, start, end)
            mem = (self.regions.mem_type, shard.peer.regions.mem_type)
            posted = self.loop.post(
                "READ", local_descs, remote_descs, shard.peer.name, mem, self.window.run_s,
                on_end,
            )  # fmt: skip
        with self._settled:
            shard.posting = False
            if posted is not None and shard.layers_done == start:
                shard.posted = posted  # still running
            over = pending is not None and pending.outcome is not None
            self._settled.notify_all()
        if over and posted is not None:  # failed or aborted while it was being posted
            self.loop.cancel(posted, "the request is over")

    def _read_ended(self, request_id: str, shard: Shard, end: int, why: str | None) -> None:
        with self._settled:
            shard.posted = None
            pending = self._pending.get(request_id)
            if why is None:
                shard.layers_done = max(shard.layers_done, end)
            elif pending is not None and pending.outcome is None:
                logger.warning("KV read of %s failed: %s", request_id, why)
                self._fail(request_id, pending, why)
            self._settled.notify_all()

    def _num_shards(self, pending: Pending) -> int:
        senders = [s.peer.layout for s in pending.shards.values()]
        return num_senders(senders[0], self.layout) if senders else 1

    def _done(self, request_id: str, pending: Pending) -> None:
        """(Under the lock.) Every shard landed: DONE, and each sender may free its blocks."""
        assert pending.expected is not None
        first = min(pending.shards.values(), key=lambda s: s.peer.layout.group_rank)
        draft = pending.expected[2] is not None and first.draft_block_ids is not None
        pending.outcome = TransferResult(request_id, TransferStatus.DONE, meta=first.meta,
                                         draft=draft)  # fmt: skip
        for shard in pending.shards.values():
            self._replies.append((shard.peer.name, {"t": "done", "id": request_id}))

    def _fail(self, request_id: str, pending: Pending, why: str) -> None:
        """(Under the lock.) FAILED (retryable), reported once nothing touches the blocks."""
        if pending.outcome is None:
            pending.outcome = TransferResult(request_id, TransferStatus.FAILED, why, retryable=True)
        for shard in pending.shards.values():
            self._refuse(request_id, shard, why)
            if shard.posted is not None:
                self.loop.submit(functools.partial(self.loop.cancel, shard.posted, why))

    def _refuse(self, request_id: str, shard: Shard, why: str) -> None:
        """(Under the lock.) Tell a sender this side is done with its blocks (push: to stop)."""
        kind = "stop" if shard.mode == "push" and shard.dest_window_end else "refuse"
        self._replies.append((shard.peer.name, {"t": kind, "id": request_id, "error": why}))
        if threading.current_thread() is not self.loop._thread:
            self.loop.submit(lambda: None)  # wake the loop to send it now

    def _send(self, agent: str, message: dict[str, Any]) -> None:
        try:
            self.loop.notify(agent, message)
        except Exception as e:  # the sender is gone: its own lease ends the transfer there
            logger.warning("KV message to %s failed: %s", agent, e)
