"""The torch_dist backend's link probe (`LinkProber` runs it, kv_transfer/link_probe.py).

The probe goes over the transfers' own channel to the receiver, so it measures what they go
over (NCCL between GPUs: NVLink, InfiniBand; gloo on CPU). NCCL matches messages by issue
order, so the probe is a message the receiver expects in the channel's order: the sender's send
thread pushes a header `{"probe": {"nbytes", "tags"}}` onto the channel's queue, as it pushes a
transfer's, and posts `BURSTS` sends of `PROBE_BYTES` right after it; the receiver's channel
thread, popping that header in its turn, posts as many receives into a scratch buffer, waits for
them (the transfer timeout), and drops the bytes. Transfers posted after the probe follow it in
that same order on both sides.

Timed as the device times it: a mark (`PairLink.mark`) after each burst: a CUDA event on the
link's stream on GPU, the wall time at which the send completed on CPU (gloo's send completes
once the receiver has taken the bytes into its socket). The first burst also waits for the
receiver to pop the header and post its receives, so it is not timed; the rate is the other
bursts' bytes over the time from the first mark to the last. NOTE: over their whole span, not
the fastest one: on CPU a mark is stamped by the thread that waits the works, whose wake-up
on a busy machine is as long as a burst (the fastest of single bursts read up to 100x high on
the project's 2-core VM; the span of 4 bursts keeps loopback gloo within 1.6-2.7 GB/s there).
Cost: `BURSTS * PROBE_BYTES` (20 MiB) once per receiver, and a 4 MiB buffer on each side while
it runs.

Bounded: the probe waits up to the sender's `timeout_s` for its bursts to be posted and then to
complete; a receiver that never takes them (stalled, or busy past the timeout) leaves the rate
unknown, and the send thread then fails the channel as it fails one whose transfer made no
progress (the next transfer opens a new one). A receiver of an older version, which would not
know the header, says nothing of probes at the handshake and is never probed. `cancel` ends a
wait at once.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from duet.kv_transfer.torch_dist.channel import Channel
from duet.kv_transfer.torch_dist.link import LinkEvent, LinkMark

PROBE_BYTES = 4 << 20  # one burst
BURSTS = 5  # the first is not timed
MAX_PROBE_BYTES = 16 * PROBE_BYTES  # the most a receiver takes for one probe
WAIT_POLL_S = 0.005  # between looks at whether the bursts completed (they are timed by marks)


@dataclass
class ProbeJob:
    """One probe on the sender's side: built by `TorchDistProbe.measure`, posted by the send
    thread (`post_probe`), which sets `posted` once it did (or could not: `error`)."""

    channel: Channel
    payload: torch.Tensor  # [PROBE_BYTES] uint8 on the caches' device; read until `sent`
    tags: list[int]
    marks: list[LinkMark] = field(default_factory=list)  # after each burst
    sent: LinkEvent | None = None  # recorded after the last burst
    posted: threading.Event = field(default_factory=threading.Event)
    error: str | None = None

    def header(self) -> dict[str, Any]:
        return {"probe": {"nbytes": self.payload.nbytes, "tags": self.tags}}

    def gbps(self) -> float:
        """The timed bursts' bytes over the time from the first mark to the last (once `sent`
        completed): the first burst, before the first mark, is not timed."""
        elapsed_s = self.marks[-1].seconds_since(self.marks[0])
        return (len(self.marks) - 1) * self.payload.nbytes / max(elapsed_s, 1e-9) / 1e9


def post_probe(job: ProbeJob) -> None:
    """The send thread: the probe's header, then its bursts, in the channel's order."""
    channel = job.channel
    channel.store.queue_push(f"{channel.cid}/xfers", json.dumps(job.header()))
    for tag in job.tags:
        channel.link.send(job.payload, tag)
        job.marks.append(channel.link.mark())
    job.sent = channel.link.record()


def probe_scratch(header: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """The receiver: a buffer for a probe's bursts, and their tags; ValueError for a probe
    larger than `MAX_PROBE_BYTES`."""
    nbytes, tags = int(header["nbytes"]), [int(t) for t in header["tags"]]
    if not 0 < nbytes * len(tags) <= MAX_PROBE_BYTES:
        raise ValueError(f"a link probe of {len(tags)} x {nbytes} bytes")
    return torch.empty(nbytes, dtype=torch.uint8, device=device), tags


class TorchDistProbe:
    """`Probe` over the sender's open channels: `channel_of(dest)` finds the channel, `post`
    hands a `ProbeJob` to the send thread."""

    def __init__(
        self,
        channel_of: Callable[[str], Channel | None],
        post: Callable[[ProbeJob], None],
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self._channel_of = channel_of
        self._post = post
        self._device = device
        self._timeout_s = timeout_s
        self._cancelled = threading.Event()

    def measure(self, dest: str) -> float:
        channel = self._channel_of(dest)
        if channel is None or channel.failed:
            raise ConnectionError(f"no open KV channel to {dest}")
        if not channel.probes:
            raise ConnectionError(f"the KV receiver {dest} does not take link probes")
        if self._cancelled.is_set():
            raise ConnectionError("the sender is closing")
        payload = torch.zeros(PROBE_BYTES, dtype=torch.uint8, device=self._device)
        job = ProbeJob(channel, payload, [next(channel.tags) for _ in range(BURSTS)])
        self._post(job)
        deadline = time.monotonic() + self._timeout_s
        self._wait(job.posted.is_set, deadline, "posted")
        if job.error is not None:
            raise ConnectionError(job.error)
        sent = job.sent
        assert sent is not None
        self._wait(sent.query, time.monotonic() + self._timeout_s, "taken by the receiver")
        return job.gbps()

    def _wait(self, done: Callable[[], bool], deadline: float, what: str) -> None:
        while not done():
            if self._cancelled.is_set():
                raise ConnectionError("the sender is closing")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the link probe was not {what} within {self._timeout_s:g}s")
            self._cancelled.wait(WAIT_POLL_S)

    def cancel(self) -> None:
        self._cancelled.set()
