"""The `tcp` backend: KV blocks between CPU caches over a channel per (sender, receiver) of
`stripes` TCP connections (2 by default), with no staging copy on either side.

`torch_dist` over gloo gathers a request's blocks into a contiguous buffer, sends it, receives
it into another and scatters it: four passes over the bytes where one contiguous send makes two
(the kernel's copies out of and into user memory). On CPU those extra copies cost as much as
the wire, so that path runs at about half the speed of a raw send on loopback. Here the kernel
copies straight out of the sender's block rows and into the receiver's reserved ones
(`sockio`: `sendmsg`/`recvmsg` with one iovec per block row). A payload of at least
`STRIPE_MIN_BYTES` per connection is cut into equal shares of bytes, one per connection, moved
at once (`_Stripes`): on loopback one stream keeps only ~1.4 of 2 cores busy, since each side
waits on the other's copies; two moved 256 SmolLM2 fp32 blocks at 0.85-1.08x a raw gloo send
where one managed ~0.7x (docs/benchmarks.md, "KV transfer").

Protocol (frames are a 4-byte big-endian length and a JSON header, all on the channel's first
connection; a `kv` frame's payload follows its header, striped over the connections):

- handshake: the sender sends `{"layout"}`, the receiver answers `{"verdict": {"layout",
  "channel"}}` or `{"verdict": {"error"}}` (a mismatch refused on both sides, as in torch_dist);
  each further connection sends `{"attach": channel, "stripe": i}` (i = 1, 2, ... in order) and
  is answered `{"attached": i}`;
- `{"type": "xfer", "request_id", "num_blocks", "meta", "trailer"}` announces a transfer;
- `{"type": "kv", "request_id", "start", "end", "nbytes", "stripes"}` + layers [start, end) of
  it, laid out `[end - start, 2, n, BS, h, D]`, sent as soon as those layers are in the sender's
  cache (layer-wise: while later layers still compute); share j of `stripes` (bytes
  [j * nbytes // stripes, ...), the last one to the end) goes over connection j;
- `{"type": "meta", "request_id", "meta"}`: a layer-wise transfer's trailer (the first token);
- `{"type": "cancel", "request_id", "error"}`: the sender gave the transfer up;
- receiver to sender: `{"type": "ack", "request_id"}` once every byte is in the blocks.

Where the data lands: an expected request (its `expect` came before its `xfer`) whose shard
holds all the receiver's heads is received straight into its reserved blocks. Anything else (a
request nobody expects yet, a head shard from a sender with larger tensor parallelism) lands in
a staging buffer that the engine thread scatters, as in torch_dist.

Ownership: the sender reads its blocks until its thread has handed their last byte to the
kernel; `poll` reports a transfer's outcome (DONE, FAILED, ABORTED) only after that, so the
caller never frees blocks under a send. The receiver writes an expected request's blocks only
while it is still expected: `abort` waits for a write in progress (shutting the connection down
if it stalls: every connection of the channel), and `poll` does not time a request out under
a write; after either, anything still on the wire for the request is read and dropped.

Timeouts: every socket operation gives up after `timeout_s` without progress; the receiver
gives up on a request at its `expect` deadline; the sender reports FAILED (retryable) when no
acknowledgement comes within `ack_timeout_s` of its last byte, or when the connection breaks.
A broken connection is never reused; the next send to that receiver opens a new channel.
"""

from __future__ import annotations

import json
import logging
import queue
import select
import socket
import struct
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_transfer import sockio
from kv_transfer.base import KVSender, TransferResult, TransferStatus
from kv_transfer.inbox import Arrival, InboxKVReceiver
from kv_transfer.layout import HandshakeError, KVLayout, check_compatible, receiver_head_slice
from kv_transfer.staging import StagingLease, StagingPool
from kv_transfer.torch_dist import layer_chunks

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
MAX_HEADER_BYTES = 1 << 20
_TICK_S = 0.5  # how often idle threads look at their stop flag
MAX_STRIPES = 16
STRIPE_MIN_BYTES = 4 << 20
"""A payload is striped only where each connection gets at least this much: below it the
helper threads' hand-off costs more than a second stream saves."""
ABORT_WAIT_S = 2.0
"""How long `abort` waits for a write into the aborted blocks to end before shutting the
connection down (a chunk takes milliseconds; only a stalled sender takes longer)."""


# -- framing -----------------------------------------------------------------------------------


def _frame(header: dict[str, Any]) -> bytes:
    body = json.dumps(header).encode()
    return _LENGTH.pack(len(body)) + body


def _read_exact(sock: socket.socket, num_bytes: int) -> bytes:
    buf = bytearray(num_bytes)
    view = memoryview(buf)
    got = 0
    while got < num_bytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n
    return bytes(buf)


def _read_frame(sock: socket.socket) -> dict[str, Any]:
    (length,) = _LENGTH.unpack(_read_exact(sock, _LENGTH.size))
    if length > MAX_HEADER_BYTES:
        raise ConnectionError(f"frame header of {length} bytes: not a duet KV peer")
    header: dict[str, Any] = json.loads(_read_exact(sock, length))
    return header


def _wait_readable(sock: socket.socket, stop: threading.Event, timeout_s: float | None) -> bool:
    """Block until `sock` has data (True), `stop` is set or `timeout_s` passed (False)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not stop.is_set():
        tick = _TICK_S if deadline is None else min(_TICK_S, deadline - time.monotonic())
        if tick <= 0:
            return False
        readable, _, _ = select.select([sock], [], [], tick)
        if readable:
            return True
    return False


def _readable(sock: socket.socket) -> bool:
    """Data (or the peer's close) is waiting; never blocks. False for a closed socket."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True  # closed: the recv reports it
    return bool(readable)


def _shutdown(sock: socket.socket) -> None:
    """End the connection both ways: blocked sends and receives on it return at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already down


def _configure(sock: socket.socket, timeout_s: float) -> None:
    sock.settimeout(None)  # blocking descriptor; the kernel enforces the timeouts
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sockio.set_timeouts(sock, timeout_s)


def _split_address(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


class _Stripes:
    """A channel's connections. The first carries every frame and the first share of a
    payload; a large payload is cut into equal shares of bytes (`sockio.split_iovecs`), one per
    connection, moved at once by helper threads. One TCP stream on loopback leaves cores idle
    while each side waits on the other's copies; parallel streams (as NCCL's socket transport
    opens) keep both busy."""

    def __init__(self, first: socket.socket, name: str) -> None:
        self.socks = [first]
        self.name = name
        self._pool: ThreadPoolExecutor | None = None

    def add(self, sock: socket.socket) -> None:
        self.socks.append(sock)
        if self._pool is None:  # starts a thread per share moving at once, no more
            self._pool = ThreadPoolExecutor(MAX_STRIPES - 1, thread_name_prefix=self.name)

    def count(self, nbytes: int) -> int:
        """How many connections a payload of `nbytes` goes over."""
        return max(1, min(len(self.socks), nbytes // STRIPE_MIN_BYTES))

    def move(self, iov: torch.Tensor, send: bool, stripes: int, head: bytes = b"") -> None:
        """Send (or receive) the bytes `iov` points at over the first `stripes` connections,
        `head` first on the first one. Returns once every share has moved; the first error of
        any share shuts every connection down (so no share waits out its timeout) and is raised.
        The helpers' waits end: each socket operation gives up after its timeout without
        progress, and a shut-down socket fails at once."""
        parts = sockio.split_iovecs(iov, stripes) if stripes > 1 else [iov]
        move = sockio.send_iovecs if send else sockio.recv_iovecs
        helpers: list[Future[None]] = []
        for sock, part in zip(self.socks[1:stripes], parts[1:], strict=True):
            assert self._pool is not None
            helpers.append(self._pool.submit(move, sock, part))
            helpers[-1].add_done_callback(self._on_helper_done)
        error: BaseException | None = None
        try:
            if send:
                sockio.send_iovecs(self.socks[0], parts[0], head=head)
            else:
                sockio.recv_iovecs(self.socks[0], parts[0])
        except BaseException as e:
            error = e
            self.shutdown()
        for helper in helpers:
            error = error or helper.exception()  # waits for it
        if error is not None:
            raise error

    def _on_helper_done(self, helper: Future[None]) -> None:
        if helper.exception() is not None:
            self.shutdown()

    def shutdown(self) -> None:
        for sock in self.socks:
            _shutdown(sock)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for sock in self.socks:
            sock.close()


def _check_caches(kv_caches: list[torch.Tensor]) -> None:
    if not sockio.supported():
        raise ValueError("kv_backend 'tcp': needs Linux on a 64-bit machine; use torch_dist")
    if any(c.device.type != "cpu" or not c.is_contiguous() for c in kv_caches):
        raise ValueError(
            "kv_backend 'tcp': moves contiguous CPU caches only; use torch_dist (NCCL) for GPU caches"
        )


def _kv_rows(block_ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Rows of a layer's `[2 * NB, row]` view holding the blocks' K, then their V."""
    return torch.cat([block_ids, block_ids + num_blocks])


# -- sender ------------------------------------------------------------------------------------


@dataclass
class _Job:
    """One request's transfer, as the channel's send thread works through it."""

    request_id: str
    rows: torch.Tensor  # [2n] long: K rows, then V rows
    num_blocks: int
    chunks: list[tuple[int, int]]  # [start, end) layers per `kv` frame
    meta: dict[str, Any] | None
    trailer: bool
    computed: list[threading.Event] = field(default_factory=list)  # per chunk: in the cache
    meta_ready: threading.Event = field(default_factory=threading.Event)
    broken: bool = False  # the pass computing it never completed

    def __post_init__(self) -> None:
        self.computed = [threading.Event() for _ in self.chunks]

    def mark_computed(self, start: int, end: int) -> None:
        for k, (_, chunk_end) in enumerate(self.chunks):
            if start < chunk_end <= end:
                self.computed[k].set()

    def abandon(self) -> None:
        self.broken = True
        for event in self.computed:
            event.set()
        self.meta_ready.set()


@dataclass
class _Transfer:
    """The sender's record of a transfer until `poll` reports it."""

    channel: _SendChannel
    outcome: TransferResult | None = None
    released: bool = False  # the send thread no longer reads the blocks
    ack_deadline: float = float("inf")


class _SendChannel:
    def __init__(self, dest: str, stripes: _Stripes, peer: KVLayout) -> None:
        self.dest = dest
        self.stripes = stripes
        self.sock = stripes.socks[0]
        self.peer = peer
        self.jobs: queue.Queue[list[_Job] | None] = queue.Queue()
        self.inbound = bytearray()  # acknowledgements read so far
        self.broken: str | None = None
        self.thread: threading.Thread | None = None

    def shutdown(self) -> None:
        self.stripes.shutdown()


class TcpKVSender(KVSender):
    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        layout: KVLayout,
        name: str = "prefill",
        timeout_s: float = 30.0,
        ack_timeout_s: float = 60.0,
        stripes: int = 2,
    ) -> None:
        """`stripes`: connections per receiver; a payload of at least `STRIPE_MIN_BYTES` per
        connection is split across them (`_Stripes`)."""
        _check_caches(kv_caches)
        if not 1 <= stripes <= MAX_STRIPES:
            raise ValueError(f"stripes: must be in [1, {MAX_STRIPES}], got {stripes}")
        self.stripes = stripes
        self.kv_caches = kv_caches
        self.layout = layout
        self.name = name
        self.timeout_s = timeout_s
        self.ack_timeout_s = ack_timeout_s
        self._lock = threading.Lock()
        self._channels: dict[str, _SendChannel] = {}
        self._transfers: dict[str, _Transfer] = {}
        self._results: list[TransferResult] = []
        self._streaming: list[tuple[_SendChannel, _Job]] = []  # begun (engine thread)
        self._trailers: dict[str, _Job] = {}  # begun, waiting for `finish`

    def connect(self, dest: str) -> _SendChannel:
        """Open (or reuse) the channel to receiver `dest`; raises HandshakeError on mismatch."""
        with self._lock:
            channel = self._channels.get(dest)
        if channel is not None:
            self._read_acks(channel)  # a connection the receiver closed is replaced here
            if channel.broken is None:
                return channel
        sock = socket.create_connection(_split_address(dest), timeout=self.timeout_s)
        stripes = _Stripes(sock, f"kv-tcp-stripe-{self.name}")
        try:
            _configure(sock, self.timeout_s)
            sock.sendall(_frame({"layout": self.layout.to_dict()}))
            verdict = _read_frame(sock)["verdict"]
            if "error" in verdict:
                raise HandshakeError(f"receiver {dest} refused: {verdict['error']}")
            peer = KVLayout.from_dict(verdict["layout"])
            check_compatible(self.layout, peer)
            for index in range(1, self.stripes):  # the channel's other connections
                extra = socket.create_connection(_split_address(dest), timeout=self.timeout_s)
                stripes.add(extra)
                _configure(extra, self.timeout_s)
                extra.sendall(_frame({"attach": verdict["channel"], "stripe": index}))
                if _read_frame(extra).get("attached") != index:
                    raise ConnectionError(f"receiver {dest} did not attach stripe {index}")
        except BaseException:
            stripes.close()
            raise
        channel = _SendChannel(dest, stripes, peer)
        channel.thread = threading.Thread(
            target=self._send_loop, args=(channel,), name=f"kv-tcp-send-{self.name}", daemon=True
        )
        channel.thread.start()
        with self._lock:
            self._channels[dest] = channel
        return channel

    def send(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        meta: dict[str, Any] | None = None,
    ) -> None:
        opened = self._open(request_id, block_ids, dest, meta, trailer=False)
        if opened is not None:
            channel, job = opened
            job.mark_computed(0, len(self.kv_caches))
            channel.jobs.put([job])

    def begin(self, request_id: str, block_ids: list[int], dest: str) -> bool:
        opened = self._open(request_id, block_ids, dest, None, trailer=True)
        if opened is not None:
            self._streaming.append(opened)
            self._trailers[request_id] = opened[1]
        return True

    def layer_computed(self, layer: int) -> None:
        streaming = self._streaming
        if layer == 0 and streaming:  # one batch per channel: chunks go in layer order
            by_channel: dict[int, tuple[_SendChannel, list[_Job]]] = {}
            for channel, job in streaming:
                by_channel.setdefault(id(channel), (channel, []))[1].append(job)
            for channel, jobs in by_channel.values():
                channel.jobs.put(jobs)
        if layer == len(self.kv_caches) - 1:
            self._streaming = []
        for _, job in streaming:
            job.mark_computed(layer, layer + 1)

    def finish(self, request_id: str, meta: dict[str, Any] | None = None) -> None:
        job = self._trailers.pop(request_id, None)
        if job is not None:
            job.meta = meta or {}
            job.meta_ready.set()

    def _open(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        meta: dict[str, Any] | None,
        trailer: bool,
    ) -> tuple[_SendChannel, _Job] | None:
        """A transfer for the caller to queue; None when `dest` is unreachable (reported
        FAILED by `poll`)."""
        num_blocks = self.kv_caches[0].shape[1]
        bad = [b for b in block_ids if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"block_ids: {bad[0]} is not in [0, {num_blocks})")
        try:
            channel = self.connect(dest)
        except HandshakeError:
            raise
        except Exception as e:  # receiver unreachable: the router retries elsewhere
            self._report(
                TransferResult(request_id, TransferStatus.FAILED, f"{dest}: {e}", retryable=True)
            )
            return None
        ids = torch.tensor(block_ids, dtype=torch.long)
        num_layers = len(self.kv_caches)
        # Layer-wise: a frame per chunk of layers, each sent once the pass wrote it. Whole: one
        # frame; between frames both sides stop for a header, and those pauses cost a 256-block
        # SmolLM2 transfer ~25% of its time as 30 one-layer frames.
        chunks = (
            layer_chunks(num_layers, 2 * len(block_ids) * self.kv_caches[0][0, 0].nbytes)
            if trailer
            else [(0, num_layers)]
        )
        job = _Job(request_id, _kv_rows(ids, num_blocks), len(block_ids), chunks, meta, trailer)
        with self._lock:
            self._transfers[request_id] = _Transfer(channel)
        return channel, job

    # -- the channel's send thread -------------------------------------------------------------

    def _send_loop(self, channel: _SendChannel) -> None:
        while (jobs := channel.jobs.get()) is not None:
            if channel.broken is not None:
                for job in jobs:
                    self._decide(job.request_id, self._failed(channel.broken))
                    self._release(job)
                continue
            try:
                self._send_jobs(channel, jobs)
            except Exception as e:
                logger.warning("KV channel to %s lost: %s", channel.dest, e)
                channel.broken = str(e)
                self._drop_channel(channel)
                for job in jobs:
                    self._decide(job.request_id, self._failed(str(e)))
                    self._release(job)
        channel.stripes.close()

    def _send_jobs(self, channel: _SendChannel, jobs: list[_Job]) -> None:
        sock = channel.sock
        live = []
        for job in jobs:
            if self._decided(job.request_id):  # aborted before anything went out
                self._release(job)
            else:
                live.append(job)
        if not live:
            return
        sock.sendall(
            b"".join(
                _frame(
                    {
                        "type": "xfer",
                        "request_id": job.request_id,
                        "num_blocks": job.num_blocks,
                        "meta": job.meta,
                        "trailer": job.trailer,
                    }
                )
                for job in live
            )
        )
        order = sorted(
            ((end, k, job) for job in live for k, (_, end) in enumerate(job.chunks)),
            key=lambda item: item[0],
        )
        dropped: set[str] = set()
        for _, k, job in order:
            if job.request_id in dropped:
                continue
            computed = job.computed[k].wait(self.timeout_s) and not job.broken
            if not computed or self._decided(job.request_id):
                why = "aborted" if computed else "the forward pass computing it failed"
                self._cancel(sock, job, why)
                dropped.add(job.request_id)
                continue
            start, end = job.chunks[k]
            layers = self.kv_caches[start:end]
            nbytes = len(layers) * job.rows.numel() * layers[0][0, 0].nbytes
            stripes = channel.stripes.count(nbytes)
            header = {
                "type": "kv",
                "request_id": job.request_id,
                "start": start,
                "end": end,
                "nbytes": nbytes,
                "stripes": stripes,
            }
            iov = sockio.row_iovecs(layers, job.rows)
            channel.stripes.move(iov, send=True, stripes=stripes, head=_frame(header))
        for job in live:
            if job.request_id in dropped:
                continue
            if job.trailer:
                if not job.meta_ready.wait(self.timeout_s) or job.broken:
                    self._cancel(sock, job, "no first token came after the KV")
                    continue
                sock.sendall(
                    _frame({"type": "meta", "request_id": job.request_id, "meta": job.meta})
                )
            self._release(job)

    def _cancel(self, sock: socket.socket, job: _Job, why: str) -> None:
        sock.sendall(_frame({"type": "cancel", "request_id": job.request_id, "error": why}))
        self._decide(job.request_id, self._failed(why))
        self._release(job)

    # -- bookkeeping (any thread) ---------------------------------------------------------------

    @staticmethod
    def _failed(why: str) -> TransferResult:
        return TransferResult("", TransferStatus.FAILED, why, retryable=True)

    def _decided(self, request_id: str) -> bool:
        with self._lock:
            transfer = self._transfers.get(request_id)
            return transfer is None or transfer.outcome is not None

    def _decide(self, request_id: str, result: TransferResult) -> None:
        """The transfer's outcome, unless it has one already (the first word stands)."""
        with self._lock:
            transfer = self._transfers.get(request_id)
            if transfer is not None and transfer.outcome is None:
                transfer.outcome = TransferResult(
                    request_id, result.status, result.error, result.retryable
                )

    def _release(self, job: _Job) -> None:
        with self._lock:
            transfer = self._transfers.get(job.request_id)
            if transfer is not None:
                transfer.released = True
                transfer.ack_deadline = time.monotonic() + self.ack_timeout_s

    def _drop_channel(self, channel: _SendChannel) -> None:
        """A broken channel: never used again (the next send opens a new one); its thread fails
        what is queued and ends."""
        channel.shutdown()
        with self._lock:
            if self._channels.get(channel.dest) is not channel:
                return
            del self._channels[channel.dest]
        channel.jobs.put(None)

    def _report(self, result: TransferResult) -> None:
        with self._lock:
            self._results.append(result)

    # -- engine side -----------------------------------------------------------------------------

    def poll(self) -> list[TransferResult]:
        with self._lock:
            channels = list({id(t.channel): t.channel for t in self._transfers.values()}.values())
        for channel in channels:
            self._read_acks(channel)
        now = time.monotonic()
        with self._lock:
            for request_id, transfer in list(self._transfers.items()):
                thread = transfer.channel.thread
                if transfer.channel.broken is not None and not (thread and thread.is_alive()):
                    transfer.released = True  # queued after its thread ended: never sent
                if transfer.outcome is None and transfer.released and now >= transfer.ack_deadline:
                    transfer.outcome = TransferResult(
                        request_id, TransferStatus.FAILED, "no acknowledgement", retryable=True
                    )
                if transfer.outcome is not None and transfer.released:
                    self._results.append(transfer.outcome)
                    del self._transfers[request_id]
            out, self._results = self._results, []
        return out

    def _read_acks(self, channel: _SendChannel) -> None:
        """Acknowledgements that came (never blocks); a closed or broken connection fails the
        channel's transfers (those its thread still sends fail there too)."""
        error = channel.broken
        # NOTE: select first. A recv takes the socket's lock even with MSG_DONTWAIT, and taking
        # it under the send thread's sendmsg defers the socket's incoming ACKs: polling every
        # millisecond that way made 256-block transfers 1.3-1.7x slower.
        if error is None and _readable(channel.sock):
            try:
                while data := channel.sock.recv(1 << 16, socket.MSG_DONTWAIT):
                    channel.inbound += data
                error = "receiver closed the connection"
            except BlockingIOError:
                pass  # nothing more for now
            except OSError as e:
                error = str(e)
        buf = channel.inbound
        while len(buf) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buf)
            if len(buf) < _LENGTH.size + length:
                break
            header = json.loads(bytes(buf[_LENGTH.size : _LENGTH.size + length]))
            del buf[: _LENGTH.size + length]
            if header.get("type") == "ack":
                self._decide(header["request_id"], TransferResult("", TransferStatus.DONE))
        if error is not None:
            if channel.broken is None:
                logger.warning("KV channel to %s lost: %s", channel.dest, error)
                channel.broken = error
                self._drop_channel(channel)  # its send thread stops at its next write
            with self._lock:
                on_channel = [r for r, t in self._transfers.items() if t.channel is channel]
            for request_id in on_channel:
                self._decide(request_id, self._failed(error))

    def abort(self, request_id: str) -> None:
        """Reported ABORTED once the send thread let go of the blocks (at its next chunk)."""
        self._decide(request_id, TransferResult("", TransferStatus.ABORTED))

    def close(self) -> None:
        for _, job in self._streaming:  # a pass that never ended: let the send thread go
            job.abandon()
        for job in self._trailers.values():
            job.abandon()
        self._streaming, self._trailers = [], {}
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.jobs.put(None)
        for channel in channels:
            if channel.thread is not None:
                channel.thread.join(timeout=self.timeout_s)


# -- receiver ----------------------------------------------------------------------------------


@dataclass
class _Incoming:
    """A transfer a channel is receiving."""

    arrival: Arrival
    expected: tuple[list[int], float] | None  # the `expect` entry it lands in directly, or None
    rows: torch.Tensor | None  # direct: rows of the reserved blocks
    lease: StagingLease | None  # staged: the channel thread's hold on the buffer
    trailer: bool = False  # the metadata follows the KV
    meta: dict[str, Any] | None = None  # the trailer, once it came


class _RecvChannel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.stripes = _Stripes(sock, "kv-tcp-recv-stripe")
        self.token = uuid.uuid4().hex  # what the sender's other connections attach with
        self.send_lock = threading.Lock()
        self.incoming: dict[str, _Incoming] = {}

    def reply(self, header: dict[str, Any]) -> None:
        with self.send_lock:
            self.sock.sendall(_frame(header))

    def shutdown(self) -> None:
        self.stripes.shutdown()


class TcpKVReceiver(InboxKVReceiver):
    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        layout: KVLayout,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 30.0,
        advertise_host: str | None = None,
    ) -> None:
        """Listen on `host:port` (0: a free port). `address` is what senders dial:
        `advertise_host` (default `host`) and the bound port."""
        _check_caches(kv_caches)
        super().__init__(kv_caches, layout, stale_after_s=timeout_s)
        self.timeout_s = timeout_s
        self._staging = StagingPool(kv_caches[0].device)
        self._writing: dict[str, _RecvChannel] = {}  # request id -> channel writing its blocks
        self._written = threading.Condition(self._lock)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        bound = self._listener.getsockname()[1]
        shown = advertise_host or host
        self.address = f"[{shown}]:{bound}" if ":" in shown else f"{shown}:{bound}"
        self._closed = threading.Event()
        self._channels: list[_RecvChannel] = []
        self._by_token: dict[str, _RecvChannel] = {}
        self._threads = [
            threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True)
        ]
        self._threads[0].start()

    def _accept_loop(self) -> None:
        while _wait_readable(self._listener, self._closed, None):
            try:
                sock, _ = self._listener.accept()
            except OSError:
                continue
            channel = _RecvChannel(sock)
            thread = threading.Thread(
                target=self._serve_channel, args=(channel,), name="kv-tcp-recv", daemon=True
            )
            with self._lock:
                self._channels.append(channel)
                self._threads.append(thread)
            thread.start()

    def _serve_channel(self, channel: _RecvChannel) -> None:
        sock = channel.sock
        attached = False  # the socket joined another channel, which owns it now
        try:
            _configure(sock, self.timeout_s)
            if not _wait_readable(sock, self._closed, self.timeout_s):
                return
            hello = _read_frame(sock)
            if "attach" in hello:
                self._attach(sock, hello)
                attached = True
                return
            sender = KVLayout.from_dict(hello["layout"])
            try:
                check_compatible(sender, self.layout)
                receiver_head_slice(sender, self.layout)
            except HandshakeError as e:
                logger.error("refusing KV channel from %s: %s", sock.getpeername(), e)
                channel.reply({"verdict": {"error": str(e)}})
                return
            with self._lock:
                self._by_token[channel.token] = channel
            channel.reply({"verdict": {"layout": self.layout.to_dict(), "channel": channel.token}})
            while _wait_readable(sock, self._closed, None):
                self._handle(channel, sender, _read_frame(sock))
        except Exception as e:  # the sender went away or broke the protocol
            if channel.incoming:
                logger.warning("KV channel lost mid-transfer: %s", e)
            elif not self._closed.is_set():  # a sender that closed between transfers
                logger.info("KV channel closed: %s", e)
            for request_id, incoming in channel.incoming.items():
                self.fail(request_id, f"sender lost: {e}")
                if incoming.lease is not None:
                    incoming.lease.release()
            channel.incoming.clear()
        finally:
            if not attached:
                with self._lock:
                    self._by_token.pop(channel.token, None)
                channel.stripes.close()

    def _attach(self, sock: socket.socket, hello: dict[str, Any]) -> None:
        """A sender's further connection joins the channel it names, as its next stripe."""
        index = hello.get("stripe")
        with self._lock:
            owner = self._by_token.get(hello["attach"])
            if owner is None or index != len(owner.stripes.socks) or index >= MAX_STRIPES:
                raise ConnectionError(f"stripe {index} of channel {hello['attach']}: refused")
            owner.stripes.add(sock)
        sock.sendall(_frame({"attached": index}))

    def _handle(self, channel: _RecvChannel, sender: KVLayout, header: dict[str, Any]) -> None:
        kind, request_id = header.get("type"), header.get("request_id", "")
        if kind == "xfer":
            channel.incoming[request_id] = self._open(
                channel, sender, request_id, header["num_blocks"], header["meta"], header["trailer"]
            )
            self.deliver(request_id, channel.incoming[request_id].arrival)
        elif kind == "kv":
            start, end, nbytes = header["start"], header["end"], header["nbytes"]
            stripes = header.get("stripes", 1)
            if not 1 <= stripes <= min(len(channel.stripes.socks), max(1, nbytes)):
                raise ConnectionError(f"kv frame of {request_id}: {stripes} stripes")
            self._receive(channel, request_id, start, end, nbytes, stripes)
        elif kind == "meta":
            channel.incoming.pop(request_id).meta = header["meta"]
        elif kind == "cancel":
            incoming = channel.incoming.pop(request_id)
            self.fail(request_id, f"the sender gave up: {header['error']}")
            if incoming.lease is not None:
                incoming.lease.release()
        else:
            raise ConnectionError(f"unknown frame {kind!r}")

    def _open(
        self,
        channel: _RecvChannel,
        sender: KVLayout,
        request_id: str,
        num_blocks: int,
        meta: dict[str, Any] | None,
        trailer: bool,
    ) -> _Incoming:
        first = self.kv_caches[0]
        if not 1 <= num_blocks <= first.shape[1]:
            raise ConnectionError(f"xfer of {request_id}: {num_blocks} blocks")
        shape = (
            len(self.kv_caches),
            2,
            num_blocks,
            first.shape[2],
            sender.heads_per_rank,
            first.shape[4],
        )
        with self._lock:
            expected = self._expected.get(request_id)
        direct = (
            expected is not None
            and len(expected[0]) >= num_blocks
            and receiver_head_slice(sender, self.layout) is None
        )
        lease = rows = None
        if direct:
            assert expected is not None
            blocks = torch.empty(shape, dtype=first.dtype, device="meta")  # nothing staged
            ids = torch.tensor(expected[0][:num_blocks], dtype=torch.long)
            rows = _kv_rows(ids, first.shape[1])
        else:
            blocks = self._staging.take(shape, first.dtype)
            lease = StagingLease(self._staging, blocks)
        arrival = Arrival(blocks, sender, meta, lambda: None, time.monotonic(), layers_ready=0)
        arrival.release = lease.release if lease is not None else None
        incoming = _Incoming(arrival, expected if direct else None, rows, lease, trailer)

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
        channel: _RecvChannel,
        request_id: str,
        start: int,
        end: int,
        nbytes: int,
        stripes: int,
    ) -> None:
        incoming = channel.incoming[request_id]
        arrival = incoming.arrival
        want = (end - start) * arrival.blocks[0].numel() * arrival.blocks.element_size()
        if not 0 <= start < end <= arrival.num_layers or nbytes != want:
            raise ConnectionError(
                f"kv frame of {request_id}: layers [{start}, {end}), {nbytes} bytes"
            )
        if incoming.rows is None:  # staged: the engine thread scatters it
            assert incoming.lease is not None
            staging = sockio.buffer_iovecs(arrival.blocks[start:end])
            channel.stripes.move(staging, send=False, stripes=stripes)
            self.progress(arrival, end)
        else:
            with self._lock:
                writable = self._expected.get(request_id) is incoming.expected
                if writable:
                    self._writing[request_id] = channel
            if not writable:  # aborted or timed out meanwhile: read and drop
                self._drain(channel, nbytes, stripes)
            else:
                landed = False
                try:
                    iov = sockio.row_iovecs(self.kv_caches[start:end], incoming.rows)
                    channel.stripes.move(iov, send=False, stripes=stripes)
                    landed = True
                finally:
                    with self._written:
                        del self._writing[request_id]
                        if landed:
                            arrival.layers_ready = arrival.layers_written = end
                            arrival.time_s = time.monotonic()
                        self._written.notify_all()
        if end == arrival.num_layers:
            if incoming.lease is not None:  # this thread's hold on the buffer
                incoming.lease.release()
                incoming.lease = None
            if not incoming.trailer:
                channel.incoming.pop(request_id)

    def _drain(self, channel: _RecvChannel, nbytes: int, stripes: int) -> None:
        """Read a payload of `nbytes` and drop it: every iovec points at one scratch buffer
        (stripes may overwrite each other's bytes there; nobody reads them)."""
        scratch = self._staging.take((min(nbytes, 4 << 20),), torch.uint8)
        try:
            size = scratch.numel()
            iov = torch.tensor([[scratch.data_ptr(), size]], dtype=torch.int64)
            iov = iov.repeat(-(-nbytes // size), 1)
            iov[-1, 1] = nbytes - size * (iov.shape[0] - 1)
            channel.stripes.move(iov, send=False, stripes=stripes)
        finally:
            self._staging.give(scratch)

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
                    self._writing[request_id].shutdown()
                    deadline = float("inf")
                self._written.wait(min(max(left, 0.01), _TICK_S))

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
