"""`TorchDistKVSender`: a thread gathers each piece of a request's blocks into a slot of the
bounded staging pool and sends it over the channel's link (see the package's docstring)."""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
import uuid
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from duet.cluster_auth.handshake import AuthenticationError, check_store_proof, store_proof
from duet.engine.device import bind_thread
from duet.kv_transfer.base import KVSender, TransferResult
from duet.kv_transfer.config import SenderConfig
from duet.kv_transfer.layers import PagedLayers
from duet.kv_transfer.layout import HandshakeError, KVLayout, checked_route
from duet.kv_transfer.link_probe import LinkProber
from duet.kv_transfer.outbox import Outbox
from duet.kv_transfer.staging import StagingError, StagingPool
from duet.kv_transfer.torch_dist.acks import AckWatcher
from duet.kv_transfer.torch_dist.channel import (
    ACCEPT_QUEUE,
    Channel,
    as_timedelta,
    check_emulation,
    meta_key,
)
from duet.kv_transfer.torch_dist.config import TorchDistSenderConfig
from duet.kv_transfer.torch_dist.link import (
    LinkError,
    link_kind,
    open_link,
    set_nccl_error_handling,
)
from duet.kv_transfer.torch_dist.probe import ProbeJob, TorchDistProbe, post_probe
from duet.kv_transfer.torch_dist.send_job import Posted, SendJob

logger = logging.getLogger(__name__)

REAP_S = 0.001  # the send thread's pause between looks at sends in flight


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
        # CUDA: gathers run on a stream of their own, after the pass's event for their layers
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._inflight: list[Posted] = []  # send thread: pieces posted, not yet known sent
        self._streaming: list[SendJob] = []  # begun, computed layer by layer (engine thread)
        self._trailers: dict[str, SendJob] = {}  # begun, waiting for `finish`
        self._probing: list[ProbeJob] = []  # send thread: probes posted, not yet known sent
        self._jobs: queue.Queue[list[SendJob] | ProbeJob | None] = queue.Queue()  # sent together
        self._prober = (
            LinkProber(TorchDistProbe(self._open_channel, self._jobs.put, device, self.timeout_s),
                       self._outbox, self.name, self.timeout_s) if config.measure_link else None
        )  # fmt: skip
        self._worker = threading.Thread(
            target=self._send_loop, name=f"kv-send-{config.name}", daemon=True
        )
        self._worker.start()

    def connect(self, dest: str) -> Channel:
        """Open (or reuse) the channel to receiver `dest`; raises HandshakeError on mismatch."""
        with self._lock:
            channel = self._channels.get(dest)
        # NOTE: a failed channel is never reused, even in the moment before `_fail_channel`
        # takes it out (a send then would fail with it: seen as a flaky retry test).
        if channel is not None and not channel.failed:
            return channel
        host, port = dest.rsplit(":", 1)
        timeout = as_timedelta(self.timeout_s)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        cid = f"{self.name}-{uuid.uuid4().hex[:12]}"
        store.set(f"{cid}/layout/sender", json.dumps(self.layout.to_dict()))
        device = self.kv_caches[0].device
        store.set(f"{cid}/link/sender", link_kind(device, self.emulate_nccl))
        store.queue_push(ACCEPT_QUEUE, cid)
        challenge = self._prove(store, cid)
        store.wait([f"{cid}/verdict"], as_timedelta(self.timeout_s))
        verdict = json.loads(store.get(f"{cid}/verdict"))
        if verdict.get("error") == "not authenticated":
            raise AuthenticationError(
                f"KV receiver {dest} refused this sender: it holds a different cluster secret"
            )
        if "error" in verdict:
            raise HandshakeError(f"receiver {dest} refused: {verdict['error']}")
        secret = self.config.secret
        if secret is not None and not check_store_proof(
            secret, "receiver", cid, challenge, verdict.get("proof")
        ):
            raise AuthenticationError(f"KV receiver {dest} did not prove the cluster secret")
        peer = KVLayout.from_dict(verdict["layout"])
        route = checked_route(self.layout, peer)
        link = open_link(
            dist.PrefixStore(cid, store), 0, device, self.timeout_s, self.emulate_nccl, cid
        )
        # NOTE: a client of its own for the ack thread: a read from a stalled receiver's store
        # blocks (no timeout) and would hold the client's lock under `finish` and the headers.
        ack_store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        channel = Channel(cid, store, ack_store, link, peer, itertools.count(1))
        channel.probes = verdict.get("probes", False) is True
        channel.heads = route.src_slice
        # Pieces fit both sides' pools (the receiver stages each one whole).
        channel.max_piece_bytes = min(self._staging.max_piece_bytes, verdict["max_piece_bytes"])
        with self._lock:
            self._channels[dest] = channel
        return channel

    def _prove(self, store: dist.Store, cid: str) -> str:
        """Answer the receiver's challenge for channel `cid` (cluster_auth/handshake.py);
        returns the challenge ("" without a secret)."""
        if self.config.secret is None:
            return ""
        store.wait([f"{cid}/challenge"], as_timedelta(self.timeout_s))
        challenge = store.get(f"{cid}/challenge").decode()
        store.set(f"{cid}/proof/sender", store_proof(self.config.secret, "sender", cid, challenge))
        return challenge

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

    def _send_loop(self) -> None:
        """Post each batch as it comes; between batches, learn which sends completed (never
        waiting on one: a stalled channel holds up no other)."""
        bind_thread(self.kv_caches[0].device)
        while True:
            try:
                batch = self._jobs.get(timeout=REAP_S if self._inflight or self._probing else None)
            except queue.Empty:
                batch = []
            if batch is None:
                return
            if isinstance(batch, ProbeJob):
                self._send_probe(batch)
            elif batch:
                self._send_batch(batch)
            self._reap()

    def _send_batch(self, batch: list[SendJob]) -> None:
        try:  # NOTE: before any header: a failure here leaves every channel in step
            self._staging.ensure()
        except StagingError as e:
            logger.error("KV transfers %s failed: %s", [j.request_id for j in batch], e)
            for job in batch:
                self._outbox.fail(job.request_id, str(e))
                job.release_blocks(self._outbox)
            return
        live = []
        for job in batch:
            if job.channel.failed:  # opened just before its channel failed
                self._outbox.fail(job.request_id, "its KV channel failed")
                job.release_blocks(self._outbox)
            elif self._outbox.decided(job.request_id):  # aborted before anything went out
                job.release_blocks(self._outbox)
            else:
                live.append(job)
        # Pieces go in layer order across requests: each as soon as a forward pass wrote it.
        order = sorted(
            ((piece[1], k, job) for job in live for k, piece in enumerate(job.pieces)),
            key=lambda item: item[0],
        )
        by_channel: dict[str, list[SendJob]] = {}
        for job in live:
            by_channel.setdefault(job.channel.cid, []).append(job)
        for jobs in by_channel.values():
            channel = jobs[0].channel
            index = {id(job): t for t, job in enumerate(jobs)}
            header = {  # the receiver posts its receives in exactly this order
                "transfers": [job.describe() for job in jobs],
                "order": [[index[id(job)], k] for _, k, job in order if id(job) in index],
            }
            try:
                channel.store.queue_push(f"{channel.cid}/xfers", json.dumps(header))
            except Exception as e:
                self._fail_channel(channel, str(e), jobs)
        for _, k, job in order:
            channel = job.channel
            if not channel.failed:
                try:
                    self._send_piece(job, k)
                except Exception as e:  # NOTE: the receiver would now match later pieces wrongly
                    self._fail_channel(channel, str(e), [j for j in live if j.channel is channel])
        for job in live:  # gathered every piece, or gave up on the rest
            if job.channel.failed and job.num_sent < len(job.pieces):  # failed mid-batch (reap)
                self._outbox.fail(job.request_id, job.error or "its KV channel failed")
            job.release_blocks(self._outbox)

    def _send_piece(self, job: SendJob, k: int) -> None:
        """Gather piece k into a staging slot (waiting for room) and post its send."""
        channel = job.channel
        if not job.computed[k].wait(self.timeout_s) or job.broken:
            raise RuntimeError("the forward pass computing the KV never completed")
        layers = job.layers
        data = self._take(layers.shape.piece_shape(job.pieces[k]), channel)
        try:
            gathered = None
            if self._copy_stream is not None:
                with torch.cuda.stream(self._copy_stream):
                    if job.ready[k] is not None:
                        self._copy_stream.wait_event(job.ready[k])
                    layers.gather_piece(job.pieces[k], data)
                    gathered = job.last_gather = torch.cuda.Event()
                    gathered.record(self._copy_stream)
            else:
                layers.gather_piece(job.pieces[k], data)
            job.num_gathered += 1
            if job.num_gathered == len(job.pieces):
                job.release_blocks(self._outbox)
            channel.link.send(data, job.tags[k], after=gathered)
        except BaseException:
            self._staging.give(data)  # never posted: nothing reads it
            raise
        self._inflight.append(Posted(job, data, channel.link.record()))
        self._outbox.sent_chunk(job.request_id)
        channel.progress_s = time.monotonic()

    def _take(self, shape: tuple[int, ...], channel: Channel) -> torch.Tensor:
        """A staging slot for a piece; while the pool is full, the sends in flight complete
        and give theirs back (this thread reaps them). StagingError after `timeout_s`."""

        def reap() -> bool:
            self._reap()
            if channel.failed:
                raise ConnectionError("its KV channel failed")
            return False

        return self._staging.take(shape, self.kv_caches[0].dtype, self.timeout_s, between=reap)

    def _send_probe(self, probe: ProbeJob) -> None:
        """Post a link probe in the channel's order (probe.py); `measure` waits for it."""
        channel = probe.channel
        try:
            if channel.failed:
                raise ConnectionError("its KV channel failed")
            post_probe(probe)
            channel.progress_s = time.monotonic()
            self._probing.append(probe)
        except Exception as e:  # NOTE: as for a chunk: the receiver would now be out of step
            probe.error = str(e)
            self._fail_channel(channel, str(e), [p.job for p in self._inflight])
        finally:
            probe.posted.set()

    def _reap(self) -> None:
        """Give back the slots of sends that completed; fail the channels that made no
        progress within the timeout (or whose link failed). A failed channel's slots come
        back at once: its link is aborted, and a late read of a reused slot only sends garbage
        to a peer that drops it."""
        now = time.monotonic()
        for posted in self._inflight:
            channel = posted.job.channel
            if channel.failed:
                continue
            try:
                posted.done = posted.sent.query()
            except LinkError as e:
                self._fail_channel(channel, str(e), [p.job for p in self._inflight])
                continue
            if posted.done:
                channel.progress_s = now
                posted.job.num_sent += 1
            elif now - channel.progress_s > self.timeout_s:
                why = f"no progress sending KV for {self.timeout_s:g}s"
                self._fail_channel(channel, why, [p.job for p in self._inflight])
        inflight = []
        for posted in self._inflight:
            if posted.done or posted.job.channel.failed:
                self._staging.give(posted.data)
            else:
                inflight.append(posted)
        self._inflight = inflight
        probing = []
        for probe in self._probing:  # a probe the receiver never takes stalls the channel too
            channel = probe.channel
            assert probe.sent is not None
            try:
                sent = channel.failed or probe.sent.query()
            except LinkError as e:
                self._fail_channel(channel, str(e), [p.job for p in self._inflight])
                continue
            if sent:
                channel.progress_s = now
            elif now - channel.progress_s > self.timeout_s:
                why = f"no progress sending a link probe for {self.timeout_s:g}s"
                self._fail_channel(channel, why, [p.job for p in self._inflight])
            else:
                probing.append(probe)
        self._probing = probing

    def _fail_channel(self, channel: Channel, error: str, jobs: list[SendJob]) -> None:
        """Abort `channel`'s link and fail its unfinished transfers among `jobs` (retryable)."""
        if not channel.failed:
            channel.failed = True
            logger.warning("KV channel %s failed: %s", channel.cid, error)
            # NOTE: never reuse this channel (the next send opens a new one). Out of the table
            # before the abort, which can take a while.
            with self._lock:
                for dest, open_channel in list(self._channels.items()):
                    if open_channel is channel:
                        del self._channels[dest]
            channel.link.abort()
        for job in jobs:
            if job.channel is channel and job.num_sent < len(job.pieces) and job.error is None:
                job.error = error
                self._outbox.fail(job.request_id, error)

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
        self._jobs.put(None)
        self._worker.join(timeout=self.timeout_s)
        self._acks.close()
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.link.close()
