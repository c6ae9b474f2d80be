"""`SendThread`: the torch_dist sender's one thread that touches the links. It posts each
batch of transfers as it comes (headers first, then every piece in layer order across the
batch, each gathered into a slot of the bounded staging pool), and between batches learns
which sends completed, never waiting on one, so a stalled channel holds up no other. A
channel with no progress within `timeout_s` (or whose link failed) is aborted and its
unfinished transfers failed (retryable); the next send there opens a new channel."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from duet.engine.device import bind_thread
from duet.kv_transfer.outbox import Outbox
from duet.kv_transfer.staging import StagingError, StagingPool
from duet.kv_transfer.torch_dist.channel import Channel
from duet.kv_transfer.torch_dist.link import LinkError
from duet.kv_transfer.torch_dist.probe import ProbeJob, post_probe
from duet.kv_transfer.torch_dist.send_job import Posted, SendJob

logger = logging.getLogger(__name__)

REAP_S = 0.001  # the send thread's pause between looks at sends in flight

Batch = list[SendJob] | ProbeJob | None
"""What the sender queues: transfers opened together, a link probe, or None (stop)."""


class SendThread:
    """Posts what `jobs` yields until it yields None. Every attribute but `jobs` belongs to
    the thread; `forget(channel)` (the sender's) takes a failed channel out of its table."""

    def __init__(
        self,
        name: str,
        device: torch.device,
        dtype: torch.dtype,
        staging: StagingPool,
        outbox: Outbox,
        timeout_s: float,
        forget: Callable[[Channel], None],
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.staging = staging
        self.outbox = outbox
        self.timeout_s = timeout_s
        self.forget = forget
        self.jobs: queue.Queue[Batch] = queue.Queue()  # transfers sent together, probes
        # CUDA: gathers run on a stream of their own, after the pass's event for their layers
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._inflight: list[Posted] = []  # pieces posted, not yet known sent
        self._probing: list[ProbeJob] = []  # probes posted, not yet known sent
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """End the thread once it posted what was queued before (waits up to `timeout_s`)."""
        self.jobs.put(None)
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        bind_thread(self.device)
        while True:
            try:
                batch = self.jobs.get(timeout=REAP_S if self._inflight or self._probing else None)
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
        outbox = self.outbox
        try:  # NOTE: before any header: a failure here leaves every channel in step
            self.staging.ensure()
        except StagingError as e:
            logger.error("KV transfers %s failed: %s", [j.request_id for j in batch], e)
            for job in batch:
                outbox.fail(job.request_id, str(e))
                job.release_blocks(outbox)
            return
        live = []
        for job in batch:
            if job.channel.failed:  # opened just before its channel failed
                outbox.fail(job.request_id, "its KV channel failed")
                job.release_blocks(outbox)
            elif outbox.decided(job.request_id):  # aborted before anything went out
                job.release_blocks(outbox)
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
                outbox.fail(job.request_id, job.error or "its KV channel failed")
            job.release_blocks(outbox)

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
                job.release_blocks(self.outbox)
            channel.link.send(data, job.tags[k], after=gathered)
        except BaseException:
            self.staging.give(data)  # never posted: nothing reads it
            raise
        self._inflight.append(Posted(job, data, channel.link.record()))
        self.outbox.sent_chunk(job.request_id)
        channel.progress_s = time.monotonic()

    def _take(self, shape: tuple[int, ...], channel: Channel) -> torch.Tensor:
        """A staging slot for a piece; while the pool is full, the sends in flight complete
        and give theirs back (this thread reaps them). StagingError after `timeout_s`."""

        def reap() -> bool:
            self._reap()
            if channel.failed:
                raise ConnectionError("its KV channel failed")
            return False

        return self.staging.take(shape, self.dtype, self.timeout_s, between=reap)

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
                self.staging.give(posted.data)
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
            self.forget(channel)
            channel.link.abort()
        for job in jobs:
            if job.channel is channel and job.num_sent < len(job.pieces) and job.error is None:
                job.error = error
                self.outbox.fail(job.request_id, error)
