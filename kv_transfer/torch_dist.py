"""The `torch_dist` backend: a pairwise channel per (sender, receiver), built on demand.

The receiver hosts a `TCPStore` at `address` ("host:port"). A sender opening a channel to it
writes its `KVLayout` under a fresh channel id, pushes the id onto the store's accept queue and
waits for the receiver's layout (or a refusal): the handshake. Both sides then build a 2-rank
group over a `PrefixStore` for that channel (gloo for CPU caches, NCCL for CUDA caches), so no
global world is needed and workers can come and go.

A transfer: the sender gathers the request's blocks into one tensor (on the caller's thread, so
its blocks are free to reuse as soon as `send` returns), pushes `{request_id, shape, tag, meta}`
onto the channel's queue, and a background thread sends the tensor. The receiver's channel
thread pops the header, receives the tensor and leaves it in the inbox (`InboxKVReceiver`); the
engine thread's `poll` scatters it into the blocks reserved by `expect` (only if still
expected: an aborted request's late data is dropped, never written) and acknowledges through
the store.

Timeouts: gloo ops and store waits use `timeout_s`; a receiver gives up on a request at the
`expect` deadline; a sender reports FAILED (retryable) when no acknowledgement comes within
`ack_timeout_s`, or when its peer is gone.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kv_transfer.base import KVSender, TransferResult, TransferStatus
from kv_transfer.blocks import gather_blocks
from kv_transfer.inbox import Arrival, InboxKVReceiver
from kv_transfer.layout import HandshakeError, KVLayout, check_compatible, receiver_head_slice

logger = logging.getLogger(__name__)

_ACCEPT_QUEUE = "duet/kv/accept"


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _pair_group(store: dist.Store, rank: int, device: torch.device, timeout_s: float) -> Any:
    """A 2-rank process group for one channel: NCCL between CUDA caches, else gloo."""
    if device.type == "cuda":
        # NOTE: not exercised in CI (no GPU there); the gloo path is.
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _timeout(timeout_s)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, _timeout(timeout_s))


@dataclass
class _Channel:
    cid: str
    store: dist.Store
    group: Any  # a 2-rank gloo or NCCL group (the stubs lack send/recv)
    peer_layout: KVLayout
    tags: itertools.count[int]


class TorchDistKVSender(KVSender):
    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        layout: KVLayout,
        name: str = "prefill",
        timeout_s: float = 30.0,
        ack_timeout_s: float = 60.0,
    ) -> None:
        self.kv_caches = kv_caches
        self.layout = layout
        self.name = name
        self.timeout_s = timeout_s
        self.ack_timeout_s = ack_timeout_s
        self._channels: dict[str, _Channel] = {}
        self._pending: dict[str, tuple[_Channel, float]] = {}  # request id -> (channel, deadline)
        self._results: list[TransferResult] = []
        self._lock = threading.Lock()
        self._jobs: queue.Queue[
            tuple[str, _Channel, torch.Tensor, int, dict[str, Any] | None] | None
        ] = queue.Queue()
        self._worker = threading.Thread(target=self._send_loop, name=f"kv-send-{name}", daemon=True)
        self._worker.start()

    def connect(self, dest: str) -> _Channel:
        """Open (or reuse) the channel to receiver `dest`; raises HandshakeError on mismatch."""
        channel = self._channels.get(dest)
        if channel is not None:
            return channel
        host, port = dest.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=_timeout(self.timeout_s))
        cid = f"{self.name}-{uuid.uuid4().hex[:12]}"
        store.set(f"{cid}/layout/sender", json.dumps(self.layout.to_dict()))
        store.queue_push(_ACCEPT_QUEUE, cid)
        store.wait([f"{cid}/verdict"], _timeout(self.timeout_s))
        verdict = json.loads(store.get(f"{cid}/verdict"))
        if "error" in verdict:
            raise HandshakeError(f"receiver {dest} refused: {verdict['error']}")
        peer = KVLayout.from_dict(verdict["layout"])
        check_compatible(self.layout, peer)
        device = self.kv_caches[0].device
        group = _pair_group(dist.PrefixStore(cid, store), 0, device, self.timeout_s)
        channel = _Channel(cid, store, group, peer, itertools.count(1))
        self._channels[dest] = channel
        return channel

    def send(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        meta: dict[str, Any] | None = None,
    ) -> None:
        try:
            channel = self.connect(dest)
        except HandshakeError:
            raise
        except Exception as e:  # receiver unreachable: the router retries elsewhere
            self._finish(
                TransferResult(request_id, TransferStatus.FAILED, f"{dest}: {e}", retryable=True)
            )
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
        blocks = gather_blocks(self.kv_caches, ids)  # the caller may reuse its blocks from here on
        with self._lock:
            self._pending[request_id] = (channel, time.monotonic() + self.ack_timeout_s)
        self._jobs.put((request_id, channel, blocks, next(channel.tags), meta))

    def _send_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            request_id, channel, blocks, tag, meta = job
            with self._lock:
                if request_id not in self._pending:
                    continue  # aborted before it went out
            try:
                header = {
                    "request_id": request_id,
                    "shape": list(blocks.shape),
                    "tag": tag,
                    "meta": meta,
                }
                channel.store.queue_push(f"{channel.cid}/xfers", json.dumps(header))
                channel.group.send([blocks], 1, tag).wait()
            except Exception as e:
                logger.warning("KV send of %s failed: %s", request_id, e)
                self._finish(
                    TransferResult(request_id, TransferStatus.FAILED, str(e), retryable=True)
                )

    def poll(self) -> list[TransferResult]:
        now = time.monotonic()
        with self._lock:
            pending = list(self._pending.items())
        for request_id, (channel, deadline) in pending:
            key = f"{channel.cid}/ack/{request_id}"
            try:
                acked = channel.store.check([key])
            except Exception as e:  # receiver gone
                self._finish(
                    TransferResult(request_id, TransferStatus.FAILED, str(e), retryable=True)
                )
                continue
            if acked:
                self._finish(TransferResult(request_id, TransferStatus.DONE))
            elif now >= deadline:
                self._finish(
                    TransferResult(
                        request_id, TransferStatus.FAILED, "no acknowledgement", retryable=True
                    )
                )
        with self._lock:
            out, self._results = self._results, []
        return out

    def abort(self, request_id: str) -> None:
        self._finish(TransferResult(request_id, TransferStatus.ABORTED))

    def _finish(self, result: TransferResult) -> None:
        with self._lock:
            self._pending.pop(result.request_id, None)
            self._results.append(result)

    def close(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=self.timeout_s)
        self._channels.clear()


class TorchDistKVReceiver(InboxKVReceiver):
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
        super().__init__(kv_caches, layout, stale_after_s=timeout_s)
        self.timeout_s = timeout_s
        self.store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=_timeout(timeout_s)
        )
        self.address = f"{advertise_host or host}:{self.store.port}"
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)]
        self._threads[0].start()

    def _client(self, timeout_s: float) -> dist.TCPStore:
        return dist.TCPStore(
            self.store.host, self.store.port, is_master=False, timeout=_timeout(timeout_s)
        )

    def _accept_loop(self) -> None:
        # A client of our own store: blocking pops on the master object would hold its lock.
        client = self._client(1.0)
        while not self._closed.is_set():
            try:
                cid = client.queue_pop(_ACCEPT_QUEUE, block=True).decode()
            except Exception:
                continue  # store timeout: look at _closed again
            thread = threading.Thread(
                target=self._serve_channel, args=(cid,), name=f"kv-recv-{cid}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _serve_channel(self, cid: str) -> None:
        store = self._client(self.timeout_s)
        sender = KVLayout.from_dict(json.loads(store.get(f"{cid}/layout/sender")))
        try:
            check_compatible(sender, self.layout)
            receiver_head_slice(sender, self.layout)
        except HandshakeError as e:
            logger.error("refusing KV channel %s: %s", cid, e)
            store.set(f"{cid}/verdict", json.dumps({"error": str(e)}))
            return
        store.set(f"{cid}/verdict", json.dumps({"layout": self.layout.to_dict()}))
        device = self.kv_caches[0].device
        group = _pair_group(dist.PrefixStore(cid, store), 1, device, self.timeout_s)
        headers = self._client(1.0)
        while not self._closed.is_set():
            try:
                header = json.loads(headers.queue_pop(f"{cid}/xfers", block=True))
            except Exception:
                continue  # idle channel
            request_id = header["request_id"]
            buf = torch.empty(header["shape"], dtype=self.kv_caches[0].dtype, device=device)
            try:
                group.recv([buf], 0, header["tag"]).wait()
            except Exception as e:  # the sender died mid-transfer: this channel is done
                logger.warning("KV channel %s lost while receiving %s: %s", cid, request_id, e)
                self.fail(request_id, f"sender lost: {e}")
                return
            ack_key = f"{cid}/ack/{request_id}"
            self.deliver(
                request_id,
                Arrival(
                    buf,
                    sender,
                    header.get("meta"),
                    functools.partial(store.set, ack_key, "done"),
                    time.monotonic(),
                ),
            )

    def close(self) -> None:
        """Stop the accept and channel threads (each wakes within a second) and wait for them:
        c10d objects must not be torn down under a thread still blocked in them."""
        self._closed.set()
        for thread in list(self._threads):
            thread.join(timeout=self.timeout_s)
