"""`TorchDistKVSender`: the sender's calls (`send`, or `begin` / `layer_computed` / `finish`;
`abort`, `poll`) over a table of channels (`dial.py` opens one) and one `SendThread`, which
gathers each piece of a request's blocks into a slot of the bounded staging pool and sends it
over the channel's link (see the package's docstring)."""

from __future__ import annotations

import json
import threading
from typing import Any, ClassVar

import torch

from duet.kv_transfer.base import KVSender, TransferResult
from duet.kv_transfer.config import SenderConfig
from duet.kv_transfer.layers import PagedLayers
from duet.kv_transfer.layout import KVLayout
from duet.kv_transfer.link_probe import LinkProber
from duet.kv_transfer.outbox import Outbox
from duet.kv_transfer.staging import StagingPool
from duet.kv_transfer.torch_dist.acks import AckWatcher
from duet.kv_transfer.torch_dist.channel import Channel, check_emulation, meta_key
from duet.kv_transfer.torch_dist.config import TorchDistSenderConfig
from duet.kv_transfer.torch_dist.dial import dial
from duet.kv_transfer.torch_dist.link import set_nccl_error_handling
from duet.kv_transfer.torch_dist.probe import TorchDistProbe
from duet.kv_transfer.torch_dist.send_job import SendJob
from duet.kv_transfer.torch_dist.send_thread import SendThread


class TorchDistKVSender(KVSender):
    config_type: ClassVar[type[SenderConfig]] = TorchDistSenderConfig

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        layout: KVLayout,
        config: TorchDistSenderConfig,
        draft_caches: list[torch.Tensor] | None = None,
    ) -> None:
        set_nccl_error_handling()  # before any link's NCCL group is built
        self.config = config
        self.kv_caches = kv_caches
        self.draft_caches = draft_caches
        self.layout = layout
        self.name = config.name
        self.timeout_s = config.timeout_s
        self.emulate_nccl = config.emulate_nccl
        check_emulation(kv_caches[0].device, config.emulate_nccl)
        self._channels: dict[str, Channel] = {}
        self._lock = threading.Lock()
        # A transfer's blocks are released once the send thread gathered its last piece (the
        # lease starts then, and restarts at `finish`).
        self._outbox = Outbox(config.ack_timeout_s)
        self._acks = AckWatcher(self._outbox, config.name, config.timeout_s)
        device = kv_caches[0].device
        self._staging = StagingPool(device, config.staging_bytes)
        self._streaming: list[SendJob] = []  # begun, computed layer by layer (engine thread)
        self._trailers: dict[str, SendJob] = {}  # begun, waiting for `finish`
        self._sending = SendThread(
            config.name, device, kv_caches[0].dtype, self._staging, self._outbox,
            config.timeout_s, self._forget,
        )  # fmt: skip
        self._jobs = self._sending.jobs  # batches of transfers and probes, in the links' order
        self._prober = (
            LinkProber(TorchDistProbe(self._open_channel, self._jobs.put, device, self.timeout_s),
                       self._outbox, self.name, self.timeout_s) if config.measure_link else None
        )  # fmt: skip

    def connect(self, dest: str) -> Channel:
        """Open (or reuse) the channel to receiver `dest`; raises HandshakeError on mismatch."""
        with self._lock:
            channel = self._channels.get(dest)
        # NOTE: a failed channel is never reused, even in the moment before the send thread
        # takes it out (a send then would fail with it: seen as a flaky retry test).
        if channel is not None and not channel.failed:
            return channel
        channel = dial(
            dest, self.name, self.layout, self.kv_caches[0].device,
            emulate_nccl=self.emulate_nccl, timeout_s=self.timeout_s, secret=self.config.secret,
            max_piece_bytes=self._staging.max_piece_bytes,
        )  # fmt: skip
        with self._lock:
            self._channels[dest] = channel
        return channel

    def _forget(self, channel: Channel) -> None:
        """The send thread failed `channel`: the next send to its receiver opens a new one."""
        with self._lock:
            for dest, open_channel in list(self._channels.items()):
                if open_channel is channel:
                    del self._channels[dest]

    def send(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        meta: dict[str, Any] | None = None,
        draft_block_ids: list[int] | None = None,
    ) -> None:
        job = self._open(request_id, block_ids, dest, meta, False, draft_block_ids)
        if job is not None:  # every layer is in the cache: the send thread gathers as it goes
            job.mark_computed(0, job.layers.num_layers)
            self._jobs.put([job])

    def begin(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        draft_block_ids: list[int] | None = None,
    ) -> bool:
        job = self._open(request_id, block_ids, dest, None, True, draft_block_ids)
        if job is not None:
            job.mark_computed(len(self.kv_caches), job.layers.num_layers)  # the draft's: ready
            self._streaming.append(job)
            self._trailers[request_id] = job
        return True

    def layer_computed(self, layer: int) -> None:
        streaming = self._streaming
        if layer == 0 and streaming:  # one batch: the headers go out before the first piece
            self._jobs.put(list(streaming))
        if layer == len(self.kv_caches) - 1:
            self._streaming = []
        for job in streaming:
            job.mark_computed(layer, layer + 1)

    def finish(self, request_id: str, meta: dict[str, Any] | None = None) -> None:
        job = self._trailers.pop(request_id, None)
        channel = self._outbox.channel_of(request_id)
        if job is None or channel is None or self._outbox.decided(request_id):
            return  # failed or aborted already: `poll` reports it
        try:
            channel.store.set(meta_key(channel.cid, request_id), json.dumps(meta or {}))
        except Exception as e:  # receiver gone
            self._outbox.fail(request_id, str(e))
            return
        job.finished(self._outbox)  # the acknowledgement can only come now

    def _open(
        self,
        request_id: str,
        block_ids: list[int],
        dest: str,
        meta: dict[str, Any] | None,
        trailer: bool,
        draft_block_ids: list[int] | None = None,
    ) -> SendJob | None:
        """A transfer for the caller to queue; None when `dest` is unreachable (reported
        FAILED by `poll`)."""
        channel = self._outbox.reach(request_id, dest, self.connect)
        if channel is None:
            return None
        # NOTE: ids checked here: a piece that fails to gather would leave the channel out of step
        layers = PagedLayers.of_ids(
            self.kv_caches, block_ids, self.draft_caches, draft_block_ids, channel.heads
        )
        pieces = layers.shape.pieces(channel.max_piece_bytes)
        job = SendJob(
            request_id, channel, layers, pieces, [next(channel.tags) for _ in pieces], meta,
            trailer,
        )  # fmt: skip
        self._outbox.open(request_id, channel, dest=dest)
        self._acks.watch(channel)
        if self._prober is not None:
            self._prober.start(dest)  # the first transfer there, or a retry: off this thread
        return job

    def _open_channel(self, dest: str) -> Channel | None:
        with self._lock:
            return self._channels.get(dest)

    def abort(self, request_id: str) -> None:
        self._outbox.abort(request_id)

    def poll(self) -> list[TransferResult]:
        """What the ack thread found, and expired leases: no store round trip here."""
        return self._outbox.poll()

    def link_gbps(self, dest: str) -> float | None:
        return self._outbox.link_gbps(dest)

    def close(self) -> None:
        if self._prober is not None:
            self._prober.close()
        for job in self._streaming:  # a pass that never ended: let the send thread go
            job.abandon()
        self._streaming, self._trailers = [], {}
        self._sending.stop(self.timeout_s)
        self._acks.close()
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.link.close()
