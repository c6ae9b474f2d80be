"""`TorchDistKVSender`: gathers a request's blocks into a staging buffer and a thread sends it
in chunks of whole layers over the channel's group (see the package's docstring)."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from engine.device import bind_thread
from kv_transfer.base import KVSender, TransferResult, TransferStatus
from kv_transfer.blocks import gather_blocks
from kv_transfer.chunks import layer_chunks
from kv_transfer.config import SenderConfig
from kv_transfer.layout import HandshakeError, KVLayout, check_compatible
from kv_transfer.outbox import Outbox
from kv_transfer.staging import StagingPool
from kv_transfer.torch_dist.acks import AckWatcher
from kv_transfer.torch_dist.channel import (
    ACCEPT_QUEUE,
    Channel,
    as_timedelta,
    meta_key,
    pair_group,
)
from kv_transfer.torch_dist.config import TorchDistSenderConfig

logger = logging.getLogger(__name__)


@dataclass
class SendJob:
    request_id: str
    channel: Channel
    block_ids: torch.Tensor  # [n] long, on the caches' device
    blocks: torch.Tensor  # [L, 2, n, BS, h, D], a staging buffer being filled
    chunks: list[tuple[int, int]]  # [start, end) layers per message
    tags: list[int]
    meta: dict[str, Any] | None
    trailer: bool  # layer-wise: the metadata follows under a store key (`finish`)
    gathered: list[threading.Event] = field(default_factory=list)  # per chunk: in `blocks`
    events: list[Any] = field(default_factory=list)  # per chunk: its CUDA event, on CUDA
    gather_failed: bool = False
    works: list[Any] = field(default_factory=list)
    error: str | None = None

    def __post_init__(self) -> None:
        self.gathered = [threading.Event() for _ in self.chunks]
        self.events = [None] * len(self.chunks)

    def header(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "shape": list(self.blocks.shape),
            "chunks": [[s, e, t] for (s, e), t in zip(self.chunks, self.tags, strict=True)],
            "meta": self.meta,
            "trailer": self.trailer,
        }

    def gather(self, kv_caches: list[torch.Tensor], start: int, end: int) -> None:
        """Gather layers [start, end) (the caller's thread); mark the chunks they complete."""
        try:
            gather_blocks(kv_caches[start:end], self.block_ids, out=self.blocks[start:end])
        except BaseException:
            self.fail_gather()
            raise
        for k, (_, chunk_end) in enumerate(self.chunks):
            if start < chunk_end <= end:
                if self.blocks.is_cuda:
                    self.events[k] = torch.cuda.Event()
                    self.events[k].record()
                self.gathered[k].set()

    def fail_gather(self) -> None:
        self.gather_failed = True
        for gathered in self.gathered:
            gathered.set()

    def wait_gathered(self, timeout_s: float) -> bool:
        return all(e.wait(timeout_s) for e in self.gathered) and not self.gather_failed


class TorchDistKVSender(KVSender):
    config_type: ClassVar[type[SenderConfig]] = TorchDistSenderConfig

    def __init__(
        self, kv_caches: list[torch.Tensor], layout: KVLayout, config: TorchDistSenderConfig
    ) -> None:
        self.config = config
        self.kv_caches = kv_caches
        self.layout = layout
        self.name = config.name
        self.timeout_s = config.timeout_s
        self._channels: dict[str, Channel] = {}
        self._lock = threading.Lock()
        # Transfers are released when opened: the blocks are gathered on the caller's thread
        # (the staging buffer is the send thread's); the lease restarts at `finish`.
        self._outbox = Outbox(config.ack_timeout_s)
        self._acks = AckWatcher(self._outbox, config.name, config.timeout_s)
        device = kv_caches[0].device
        self._staging = StagingPool(device)
        self._send_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._streaming: list[SendJob] = []  # begun, gathered layer by layer (engine thread)
        self._jobs: queue.Queue[list[SendJob] | None] = queue.Queue()  # sent together
        self._worker = threading.Thread(
            target=self._send_loop, name=f"kv-send-{config.name}", daemon=True
        )
        self._worker.start()

    def connect(self, dest: str) -> Channel:
        """Open (or reuse) the channel to receiver `dest`; raises HandshakeError on mismatch."""
        with self._lock:
            channel = self._channels.get(dest)
        if channel is not None:
            return channel
        host, port = dest.rsplit(":", 1)
        timeout = as_timedelta(self.timeout_s)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        cid = f"{self.name}-{uuid.uuid4().hex[:12]}"
        store.set(f"{cid}/layout/sender", json.dumps(self.layout.to_dict()))
        store.queue_push(ACCEPT_QUEUE, cid)
        store.wait([f"{cid}/verdict"], as_timedelta(self.timeout_s))
        verdict = json.loads(store.get(f"{cid}/verdict"))
        if "error" in verdict:
            raise HandshakeError(f"receiver {dest} refused: {verdict['error']}")
        peer = KVLayout.from_dict(verdict["layout"])
        check_compatible(self.layout, peer)
        device = self.kv_caches[0].device
        group = pair_group(dist.PrefixStore(cid, store), 0, device, self.timeout_s)
        channel = Channel(cid, store, group, peer, itertools.count(1))
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
        job = self._open(request_id, block_ids, dest, meta, trailer=False)
        if job is not None:  # the header goes out and chunks follow while we gather
            self._jobs.put([job])
            job.gather(self.kv_caches, 0, len(self.kv_caches))
        # the caller may reuse its blocks from here on

    def begin(self, request_id: str, block_ids: list[int], dest: str) -> bool:
        job = self._open(request_id, block_ids, dest, None, trailer=True)
        if job is not None:
            self._streaming.append(job)
        return True

    def layer_computed(self, layer: int) -> None:
        streaming = self._streaming
        if layer == 0 and streaming:  # one batch: the headers go out before the first chunk
            self._jobs.put(list(streaming))
        if layer == len(self.kv_caches) - 1:
            self._streaming = []
        for job in streaming:
            job.gather(self.kv_caches, layer, layer + 1)

    def finish(self, request_id: str, meta: dict[str, Any] | None = None) -> None:
        channel = self._outbox.channel_of(request_id)
        if channel is None or self._outbox.decided(request_id):
            return  # failed or aborted already: `poll` reports it
        try:
            channel.store.set(meta_key(channel.cid, request_id), json.dumps(meta or {}))
        except Exception as e:  # receiver gone
            self._outbox.fail(request_id, str(e))
            return
        self._outbox.release(request_id)  # the acknowledgement can only come now

    def _open(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        meta: dict[str, Any] | None,
        trailer: bool,
    ) -> SendJob | None:
        """A transfer for the caller to queue and gather; None when `dest` is unreachable
        (reported FAILED by `poll`)."""
        try:
            channel = self.connect(dest)
        except HandshakeError:
            raise
        except Exception as e:  # receiver unreachable: the router retries elsewhere
            self._outbox.report(
                TransferResult(request_id, TransferStatus.FAILED, f"{dest}: {e}", retryable=True)
            )
            return None
        first = self.kv_caches[0]
        num_blocks = first.shape[1]
        bad = [b for b in block_ids if not 0 <= b < num_blocks]
        if bad:  # caught here: a chunk that fails to gather would leave the channel out of step
            raise ValueError(f"block_ids: {bad[0]} is not in [0, {num_blocks})")
        shape = (len(self.kv_caches), 2, len(block_ids), *first.shape[2:])
        blocks = self._staging.take(shape, first.dtype)
        chunks = layer_chunks(len(self.kv_caches), blocks[0].nbytes)
        job = SendJob(
            request_id,
            channel,
            torch.tensor(block_ids, dtype=torch.long, device=first.device),
            blocks,
            chunks,
            [next(channel.tags) for _ in chunks],
            meta,
            trailer,
        )
        self._outbox.open(request_id, channel, released=True)
        self._acks.watch(channel)
        return job

    def _send_loop(self) -> None:
        bind_thread(self.kv_caches[0].device)
        while (batch := self._jobs.get()) is not None:
            stream = self._send_stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self._send_batch(batch)

    def _send_batch(self, batch: list[SendJob]) -> None:
        live = []
        for job in batch:
            if not self._outbox.decided(job.request_id):
                live.append(job)
            elif job.wait_gathered(self.timeout_s):  # before anything went out
                self._staging.give(job.blocks)
        by_channel: dict[str, list[SendJob]] = {}
        for job in live:
            by_channel.setdefault(job.channel.cid, []).append(job)
        for jobs in by_channel.values():
            channel = jobs[0].channel
            header = {"transfers": [job.header() for job in jobs]}
            try:
                channel.store.queue_push(f"{channel.cid}/xfers", json.dumps(header))
            except Exception as e:
                for job in jobs:
                    job.error = str(e)
        # Chunks go in layer order across requests: each as soon as a forward pass wrote it.
        order = sorted(
            ((end, k, job) for job in live for k, (_, end) in enumerate(job.chunks)),
            key=lambda item: item[0],
        )
        for _, k, job in order:
            if job.error is not None:
                continue
            try:
                if not job.gathered[k].wait(self.timeout_s) or job.gather_failed:
                    raise RuntimeError("gathering the blocks failed")
                event = job.events[k]
                if event is not None:
                    torch.cuda.current_stream().wait_event(event)
                start, end = job.chunks[k]
                job.works.append(job.channel.group.send([job.blocks[start:end]], 1, job.tags[k]))
            except Exception as e:
                job.error = str(e)
        for job in live:
            try:
                if job.error is not None:
                    raise RuntimeError(job.error)
                for work in job.works:
                    work.wait()
                if self._send_stream is not None:  # NCCL is done with the buffer
                    self._send_stream.synchronize()
            except Exception as e:
                self._abandon(job, str(e))
            else:
                self._staging.give(job.blocks)

    def _abandon(self, job: SendJob, error: str) -> None:
        logger.warning("KV send of %s failed: %s", job.request_id, error)
        # NOTE: the receiver may now wait for chunks that never come: never reuse this channel
        # (the next send opens a new one), nor the buffer the transport may still read.
        with self._lock:
            for dest, open_channel in list(self._channels.items()):
                if open_channel is job.channel:
                    del self._channels[dest]
        self._outbox.fail(job.request_id, error)

    def abort(self, request_id: str) -> None:
        self._outbox.abort(request_id)

    def poll(self) -> list[TransferResult]:
        """What the ack thread found, and expired leases: no store round trip here."""
        return self._outbox.poll()

    def close(self) -> None:
        for job in self._streaming:  # a pass that never ended: let the send thread go
            job.fail_gather()
        self._streaming = []
        self._jobs.put(None)
        self._worker.join(timeout=self.timeout_s)
        self._acks.close()
        self._channels.clear()
