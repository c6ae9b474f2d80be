"""`TcpKVReceiver`: listens for channels, a thread per channel reading its frames, and the
inbox (`InboxKVReceiver`) the engine thread polls (see the package's docstring for the
protocol and where the data lands)."""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from duet.cluster_auth.handshake import challenge
from duet.cluster_auth.refusals import RefusalLog
from duet.kv_transfer import sockio
from duet.kv_transfer.chunks import Piece
from duet.kv_transfer.config import ReceiverConfig
from duet.kv_transfer.inbox import Arrival, Expected, InboxKVReceiver
from duet.kv_transfer.layers import PagedLayers, TransferShape, piece_cells
from duet.kv_transfer.layout import HandshakeError, KVLayout, checked_route
from duet.kv_transfer.staging import StagingPool
from duet.kv_transfer.tcp.config import TcpReceiverConfig, check_caches
from duet.kv_transfer.tcp.framing import TICK_S, configure, frame, read_frame, wait_readable
from duet.kv_transfer.tcp.probe import MAX_PROBE_BYTES
from duet.kv_transfer.tcp.stripes import MAX_STRIPES, Stripes

logger = logging.getLogger(__name__)

DRAIN_BYTES = 4 << 20  # the scratch buffer dropped payloads are read into (every channel's)
ABORT_WAIT_S = 2.0
"""How long `abort` waits for a write into the aborted blocks to end before shutting the
connection down (a chunk takes milliseconds; only a stalled sender takes longer)."""


@dataclass
class Incoming:
    """A transfer a channel is receiving."""

    arrival: Arrival
    expected: Expected | None  # the `expect` entry it lands in directly, or None
    layers: PagedLayers | None  # direct: the reserved blocks (draft layers past them: dropped)
    trailer: bool = False  # the metadata follows the KV
    meta: dict[str, Any] | None = None  # the trailer, once it came
    num_received: int = 0  # (layer, block) cells of the pieces received so far


class RecvChannel:
    def __init__(self, sock: socket.socket, peer: str = "") -> None:
        self.sock = sock
        self.peer = peer  # the connecting host (for the log of refused peers)
        self.stripes = Stripes(sock, "kv-tcp-recv-stripe")
        self.token = uuid.uuid4().hex  # what the sender's other connections attach with
        self.send_lock = threading.Lock()
        self.incoming: dict[str, Incoming] = {}

    def reply(self, header: dict[str, Any]) -> None:
        with self.send_lock:
            self.sock.sendall(frame(header))

    def shutdown(self) -> None:
        self.stripes.shutdown()


class TcpKVReceiver(InboxKVReceiver):
    config_type: ClassVar[type[ReceiverConfig]] = TcpReceiverConfig

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        layout: KVLayout,
        config: TcpReceiverConfig,
        draft_caches: list[torch.Tensor] | None = None,
    ) -> None:
        """Listen on `config.host:port` (0: a free port). `address` is what senders dial:
        `advertise_host` (default `host`) and the bound port."""
        check_caches(kv_caches + (draft_caches or []))
        super().__init__(kv_caches, layout, config.timeout_s, draft_caches)
        self.config = config
        self.timeout_s = config.timeout_s
        self._staging = StagingPool(kv_caches[0].device, config.staging_bytes)
        self._scratch = torch.empty(DRAIN_BYTES, dtype=torch.uint8)  # what `_drain` drops
        # request id -> the channels writing its blocks now (one per sender rank: several with
        # a sender's pipeline stages, whose parts go to different layers of the same blocks)
        self._writing: dict[str, list[RecvChannel]] = {}
        self._written = threading.Condition(self._lock)
        host = config.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, config.port), family=family, backlog=64)
        bound = self._listener.getsockname()[1]
        shown = config.advertise_host or host
        self._address = f"[{shown}]:{bound}" if ":" in shown else f"{shown}:{bound}"
        self._closed = threading.Event()
        self.refusals = RefusalLog(f"KV receiver {config.name}")
        self._channels: list[RecvChannel] = []
        self._by_token: dict[str, RecvChannel] = {}
        self._threads = [
            threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True)
        ]
        self._threads[0].start()

    @property
    def address(self) -> str:
        return self._address

    def _accept_loop(self) -> None:
        while wait_readable(self._listener, self._closed, None):
            try:
                sock, peer = self._listener.accept()
            except OSError:
                continue
            channel = RecvChannel(sock, str(peer[0]))
            thread = threading.Thread(
                target=self._serve_channel, args=(channel,), name="kv-tcp-recv", daemon=True
            )
            with self._lock:
                self._channels.append(channel)
                self._threads.append(thread)
            thread.start()

    def _serve_channel(self, channel: RecvChannel) -> None:
        sock = channel.sock
        attached = False  # the socket joined another channel, which owns it now
        try:
            configure(sock, self.timeout_s)
            if not self._authenticate(channel):
                return
            if not wait_readable(sock, self._closed, self.timeout_s):
                return
            hello = read_frame(sock)
            if "attach" in hello:
                self._attach(sock, hello)
                attached = True
                return
            sender = KVLayout.from_dict(hello["layout"])
            try:
                checked_route(sender, self.layout)
            except HandshakeError as e:
                logger.error("refusing KV channel from %s: %s", sock.getpeername(), e)
                channel.reply({"verdict": {"error": str(e)}})
                return
            with self._lock:
                self._by_token[channel.token] = channel
            verdict = {
                "layout": self.layout.to_dict(),
                "channel": channel.token,
                "max_piece_bytes": self._staging.max_piece_bytes,
            }
            channel.reply({"verdict": verdict})
            while wait_readable(sock, self._closed, None):
                self._handle(channel, sender, read_frame(sock))
        except Exception as e:  # the sender went away or broke the protocol
            if channel.incoming:
                logger.warning("KV channel lost mid-transfer: %s", e)
            elif not self._closed.is_set():  # a sender that closed between transfers
                logger.info("KV channel closed: %s", e)
            for request_id in channel.incoming:
                self.fail(request_id, f"sender lost: {e}")
            channel.incoming.clear()
        finally:
            if not attached:
                with self._lock:
                    self._by_token.pop(channel.token, None)
                channel.stripes.close()

    def _authenticate(self, channel: RecvChannel) -> bool:
        """Every connection (a channel's first and each stripe) proves the cluster secret
        before a frame is read; one that does not is counted, logged once per address, closed."""
        if self.config.secret is None:
            return True
        try:
            challenge(channel.sock, self.config.secret)
        except OSError as e:  # AuthenticationError, a timeout, a reset
            self.refusals.refused(channel.peer, str(e))
            return False
        return True

    def _attach(self, sock: socket.socket, hello: dict[str, Any]) -> None:
        """A sender's further connection joins the channel it names, as its next stripe."""
        index = hello.get("stripe")
        with self._lock:
            owner = self._by_token.get(hello["attach"])
            if owner is None or index != len(owner.stripes.socks) or index >= MAX_STRIPES:
                raise ConnectionError(f"stripe {index} of channel {hello['attach']}: refused")
            owner.stripes.add(sock)
        sock.sendall(frame({"attached": index}))

    def _handle(self, channel: RecvChannel, sender: KVLayout, header: dict[str, Any]) -> None:
        kind, request_id = header.get("type"), header.get("request_id", "")
        if kind == "xfer":
            channel.incoming[request_id] = self._open(
                channel, sender, request_id, header["num_blocks"], header["meta"],
                header["trailer"], bool(header.get("draft")),
            )  # fmt: skip
            self.deliver(request_id, channel.incoming[request_id].arrival)
        elif kind == "kv":
            start, end, first, last = (int(v) for v in header["piece"])
            nbytes, stripes = header["nbytes"], header.get("stripes", 1)
            if not 1 <= stripes <= min(len(channel.stripes.socks), max(1, nbytes)):
                raise ConnectionError(f"kv frame of {request_id}: {stripes} stripes")
            self._receive(channel, request_id, (start, end, first, last), nbytes, stripes)
        elif kind == "meta":
            channel.incoming.pop(request_id).meta = header["meta"]
        elif kind == "cancel":
            channel.incoming.pop(request_id)
            self.fail(request_id, f"the sender gave up: {header['error']}")
        elif kind == "ping":  # a link probe (probe.py): read the burst, drop it, answer
            nbytes, stripes = header["nbytes"], header["stripes"]
            if not 0 <= nbytes <= MAX_PROBE_BYTES or not 1 <= stripes <= len(channel.stripes.socks):
                raise ConnectionError(f"ping of {nbytes} bytes over {stripes} stripes")
            if nbytes:
                self._drain(channel, nbytes, stripes)
            channel.reply({"type": "pong", "nbytes": nbytes})
        else:
            raise ConnectionError(f"unknown frame {kind!r}")

    def _open(
        self,
        channel: RecvChannel,
        sender: KVLayout,
        request_id: str,
        num_blocks: int,
        meta: dict[str, Any] | None,
        trailer: bool,
        draft: bool = False,
    ) -> Incoming:
        first = self.kv_caches[0]
        if not 1 <= num_blocks <= first.shape[1] or (draft and sender.draft is None):
            raise ConnectionError(f"xfer of {request_id}: {num_blocks} blocks, draft {draft}")
        d = sender.draft
        route = checked_route(sender, self.layout)  # checked at the handshake already
        caches = self.stage_caches(sender)  # the layers of the sender's pipeline stage
        draft_first = self.draft_caches[0] if draft and self.draft_caches else None
        shape = TransferShape(
            len(caches), num_blocks, (first.shape[2], route.num_heads,
            first.shape[4]), first.element_size(), d.num_layers if draft and d else 0,
            (first.shape[2], d.num_kv_heads, d.head_dim) if draft and d else (), first.shape[0],
            draft_first.shape[0] if draft_first is not None else 2,
        )  # fmt: skip
        with self._lock:
            expected = self._expected.get(request_id)
        direct = expected is not None and len(expected.block_ids) >= num_blocks and route.dst_whole
        layers = None
        if direct:
            assert expected is not None
            draft_ids = expected.draft_block_ids if draft else None
            if draft_ids is not None and len(draft_ids) < num_blocks:
                draft_ids = None  # a reservation too small for it: the draft's KV is dropped
            layers = PagedLayers.of_ids(
                caches, expected.block_ids[:num_blocks], self.draft_caches,
                draft_ids[:num_blocks] if draft_ids is not None else None,
            )  # fmt: skip
        arrival = Arrival(shape, sender, meta, lambda: None, time.monotonic())
        incoming = Incoming(arrival, expected if direct else None, layers, trailer)

        def acknowledge() -> None:
            try:
                channel.reply({"type": "ack", "request_id": request_id})
            except OSError as e:  # the sender is gone: its lease ends the transfer there
                logger.warning("could not acknowledge %s: %s", request_id, e)

        arrival.acknowledge = acknowledge
        if trailer:
            arrival.fetch_meta = lambda: incoming.meta
        return incoming

    def _receive(
        self,
        channel: RecvChannel,
        request_id: str,
        piece: Piece,
        nbytes: int,
        stripes: int,
    ) -> None:
        incoming = channel.incoming[request_id]
        arrival = incoming.arrival
        try:
            want = arrival.shape.piece_nbytes(piece)
        except ValueError:  # out of range, or not within one group
            want = -1
        if nbytes != want:
            raise ConnectionError(f"kv frame of {request_id}: piece {list(piece)}, {nbytes} bytes")
        if incoming.layers is None:  # staged: the engine thread scatters it
            dtype = self.kv_caches[0].dtype
            shape = arrival.shape.piece_shape(piece)
            # NOTE: waits for room while the inbox writes what landed (the sender's socket
            # send waits meanwhile, both bounded by the timeout)
            data = self._staging.take(shape, dtype, self.timeout_s, self._closed.is_set)
            try:
                channel.stripes.move(sockio.buffer_iovecs(data), send=False, stripes=stripes)
            except BaseException:
                self._staging.give(data)  # `move` returned: no share still writes it
                raise
            self.progress(arrival, piece, data, functools.partial(self._staging.give, data))
        else:
            with self._lock:
                writable = self._expected.get(request_id) is incoming.expected
                if writable:
                    self._writing.setdefault(request_id, []).append(channel)
            if not writable:  # aborted or timed out meanwhile: read and drop
                self._drain(channel, nbytes, stripes)
            else:
                landed = False
                try:
                    if piece[1] <= incoming.layers.num_layers:
                        iov = incoming.layers.piece_iovecs(piece)
                        channel.stripes.move(iov, send=False, stripes=stripes)
                    else:  # draft layers with no draft blocks reserved
                        self._drain(channel, nbytes, stripes)
                    landed = True
                finally:
                    with self._written:
                        writers = self._writing[request_id]
                        writers.remove(channel)
                        if not writers:
                            del self._writing[request_id]
                        if landed:
                            self.wrote(arrival, piece)
                        self._written.notify_all()
        incoming.num_received += piece_cells(piece)
        if incoming.num_received >= arrival.shape.num_cells and not incoming.trailer:
            channel.incoming.pop(request_id)

    def _drain(self, channel: RecvChannel, nbytes: int, stripes: int) -> None:
        """Read a payload of `nbytes` and drop it: every iovec points at one scratch buffer
        (stripes may overwrite each other's bytes there; nobody reads them)."""
        size = min(nbytes, DRAIN_BYTES)
        iov = torch.tensor([[self._scratch.data_ptr(), size]], dtype=torch.int64)
        iov = iov.repeat(-(-nbytes // size), 1)
        iov[-1, 1] = nbytes - size * (iov.shape[0] - 1)
        channel.stripes.move(iov, send=False, stripes=stripes)

    def _busy(self, request_id: str) -> bool:
        return request_id in self._writing

    def abort(self, request_id: str) -> None:
        """As the inbox's, and returns only once no thread writes the request's blocks."""
        super().abort(request_id)
        with self._written:
            deadline = time.monotonic() + ABORT_WAIT_S
            while request_id in self._writing:
                left = deadline - time.monotonic()
                if left <= 0:  # a stalled sender: break the write off
                    logger.warning(
                        "KV for aborted %s still arriving: closing its channel", request_id
                    )
                    for channel in self._writing[request_id]:
                        channel.shutdown()
                    deadline = float("inf")
                self._written.wait(min(max(left, 0.01), TICK_S))

    def close(self) -> None:
        """Stop the accept and channel threads and wait for them."""
        self._closed.set()
        with self._lock:
            channels = list(self._channels)
            threads = list(self._threads)
        for channel in channels:
            channel.shutdown()
        for thread in threads:
            thread.join(timeout=self.timeout_s)
        self._listener.close()
