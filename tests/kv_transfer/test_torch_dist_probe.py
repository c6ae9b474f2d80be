"""The torch_dist sender's link probe (kv_transfer/torch_dist/probe.py), under plain gloo and
under NCCL's semantics (`nccl_emu.py`: a receive posted out of order gets another message's
bytes, or never completes): it goes over the transfers' channel, in its order; it runs once
per receiver and later results carry its rate, with their chunk counts unchanged; its rate is
a burst's bytes over its time; it gives up on a receiver that never takes it within the
timeout (the channel is then failed as a stalled one is, and the next transfer opens a new
one); `close` cancels it."""

from __future__ import annotations

import functools
import os
import threading
import time

import pytest
import torch

from duet.kv_transfer import TransferStatus, chunks, create_receiver
from duet.kv_transfer.torch_dist.link import GlooLink, NcclLink
from duet.kv_transfer.torch_dist.probe import BURSTS, PROBE_BYTES, TorchDistProbe
from duet.kv_transfer.torch_dist.receiver import TorchDistKVReceiver
from tests.kv_transfer import probing
from tests.kv_transfer.paged import caches, layout
from tests.kv_transfer.probing import held_calls, probing_sender
from tests.waiting import wait_for

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture(params=["gloo", "nccl-emulated"])
def mode(request, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("DUET_KV_EMULATE_NCCL", "1" if request.param == "nccl-emulated" else "0")
    return request.param


@pytest.fixture
def probes_taken(monkeypatch):  # type: ignore[no-untyped-def]
    """The probes receivers took (their headers), an event set at the first, and a gate they
    wait at (up to 20 s) while it is clear."""
    with held_calls(
        monkeypatch, TorchDistKVReceiver, "_drop_probe", lambda cid, link, probe: probe, 20
    ) as held:
        yield held


def receiver_of(dst, timeout_s=10.0):  # type: ignore[no-untyped-def]
    return create_receiver("torch_dist", kv_caches=dst, layout=layout(dst), timeout_s=timeout_s)


transfer = functools.partial(probing.transfer, expect_timeout_s=20)
layerwise_transfer = functools.partial(probing.layerwise_transfer, expect_timeout_s=20)


def landed(src, dst, src_ids, dst_ids) -> bool:  # type: ignore[no-untyped-def]
    return all(torch.equal(d[:, dst_ids], s[:, src_ids]) for s, d in zip(src, dst, strict=True))


def probe_of(sender) -> TorchDistProbe:  # type: ignore[no-untyped-def]
    """A probe over `sender`'s channels, as its own `LinkProber` would run it."""
    return TorchDistProbe(sender._open_channel, sender._jobs.put, torch.device("cpu"), 10.0)


def test_the_probe_runs_once_over_the_channel_and_later_results_carry_it(
    mode, probes_taken, monkeypatch
):
    calls, _, _ = probes_taken
    src, dst = caches(), caches(seed=1)
    recv, sender = receiver_of(dst), probing_sender("torch_dist", src)
    try:
        first = transfer(sender, recv, "r1", [0, 5, 7], [9, 3, 12])
        assert (first.status, first.num_chunks, first.link_gbps) == (TransferStatus.DONE, 1, None)
        gbps = wait_for(lambda: sender.link_gbps(recv.address), 20, "the probed rate")
        assert gbps > 0
        [probe] = calls
        assert probe["nbytes"] == PROBE_BYTES and len(probe["tags"]) == BURSTS
        # Layer-wise, a message per layer: 3 chunks, the rate with them, the bytes in place.
        monkeypatch.setattr(chunks, "CHUNK_MIN_BYTES", 1)
        second = layerwise_transfer(sender, recv, "r2", [4, 6], [1, 2], len(src))
        assert (second.status, second.num_chunks, second.link_gbps) == (
            TransferStatus.DONE, 3, gbps,
        )  # fmt: skip
        assert landed(src, dst, [0, 5, 7, 4, 6], [9, 3, 12, 1, 2])
        assert transfer(sender, recv, "r3", [8], [0]).link_gbps == gbps
        assert len(calls) == 1  # measured once
    finally:
        sender.close()
        recv.close()


def test_a_transfer_posted_behind_a_probe_lands_its_own_bytes(mode, probes_taken):
    """The receiver takes the probe's bursts, then the transfer's chunk, in the order the
    sender posted them: under NCCL's semantics a receive out of that order would get the
    probe's bytes or, their sizes differing, never complete."""
    _, entered, gate = probes_taken
    src, dst = caches(), caches(seed=1)
    recv, sender = receiver_of(dst), probing_sender("torch_dist", src, measure_link=False)
    try:
        transfer(sender, recv, "r1", [0], [9])  # opens the channel
        gate.clear()
        rates: list[float] = []
        probing = threading.Thread(
            target=lambda: rates.append(probe_of(sender).measure(recv.address))
        )
        probing.start()
        wait_for(entered.is_set, 20, "the probe at the receiver")
        recv.expect("r2", [3, 4], timeout_s=20)
        sender.send("r2", [5, 7], recv.address)  # its chunk goes out behind the bursts
        start = time.monotonic()
        assert sender.poll() == [] and recv.poll() == []  # neither waits for the probe
        assert time.monotonic() - start < 0.5
        gate.set()
        assert [r.status for r in wait_for(recv.poll, 20, "recv.poll")] == [TransferStatus.DONE]
        assert [r.status for r in wait_for(sender.poll, 20, "sender.poll")] == [TransferStatus.DONE]
        assert landed(src, dst, [0, 5, 7], [9, 3, 4])
        probing.join(20)
        assert len(rates) == 1 and rates[0] > 0
    finally:
        sender.close()
        recv.close()


def test_the_rate_is_the_timed_bursts_bytes_over_their_time(mode, monkeypatch):
    """A receiver that posts each burst's receive 0.2 s after the last: every timed burst takes
    about that long, so the rate is about a burst's bytes over 0.2 s."""
    for link_type in (GlooLink, NcclLink):
        real = link_type.recv

        def slow_recv(self, tensor, tag, real=real):  # type: ignore[no-untyped-def]
            if tensor.dtype == torch.uint8:  # the probe's scratch
                time.sleep(0.2)
            return real(self, tensor, tag)

        monkeypatch.setattr(link_type, "recv", slow_recv)
    src, dst = caches(), caches(seed=1)
    recv, sender = receiver_of(dst), probing_sender("torch_dist", src, measure_link=False)
    try:
        transfer(sender, recv, "r1", [0], [9])
        gbps = probe_of(sender).measure(recv.address)
        # 0.2 s a burst, give or take the landing thread's wake-up on this busy machine.
        # NOTE: not every burst, but the span of the timed ones (probe.py says why).
        assert PROBE_BYTES / 0.5 / 1e9 < gbps < PROBE_BYTES / 0.15 / 1e9
    finally:
        sender.close()
        recv.close()


def test_a_probe_gives_up_on_a_receiver_that_never_takes_it(mode, probes_taken):
    """The receiver's channel thread stops at the probe: the probe gives up after the sender's
    timeout, leaving the rate unknown; `poll` never waits; the channel, stalled, is failed as
    one whose transfer made no progress, and the next transfer opens a new one."""
    _, entered, gate = probes_taken
    gate.clear()
    src, dst = caches(), caches(seed=1)
    recv, sender = receiver_of(dst, timeout_s=2.0), probing_sender("torch_dist", src, timeout_s=1.0)
    try:
        transfer(sender, recv, "r1", [0], [9])
        old = sender._open_channel(recv.address)
        wait_for(entered.is_set, 20, "the probe at the receiver")
        start = time.monotonic()
        prober = sender._prober
        while any(t.is_alive() for t in prober._threads):
            t0 = time.monotonic()
            assert sender.poll() == []
            assert time.monotonic() - t0 < 0.5
            assert time.monotonic() - start < 10, "the probe did not give up"
            time.sleep(0.01)
        assert 0.5 <= time.monotonic() - start
        assert sender.link_gbps(recv.address) is None
        wait_for(lambda: old.failed, 10, "the stalled channel failed")
        second = transfer(sender, recv, "r2", [2, 4], [1, 5])
        assert (second.status, second.num_chunks, second.link_gbps) == (
            TransferStatus.DONE, 1, None,
        )  # fmt: skip
        assert sender._open_channel(recv.address) is not old
        assert landed(src, dst, [0, 2, 4], [9, 1, 5])
    finally:
        gate.set()
        sender.close()
        recv.close()


def test_a_receiver_that_does_not_take_probes_is_not_probed(mode):
    src, dst = caches(), caches(seed=1)
    recv, sender = receiver_of(dst), probing_sender("torch_dist", src, measure_link=False)
    try:
        transfer(sender, recv, "r1", [0], [9])
        sender._open_channel(recv.address).probes = False  # as an older receiver's verdict
        with pytest.raises(ConnectionError, match="does not take link probes"):
            probe_of(sender).measure(recv.address)
        assert transfer(sender, recv, "r2", [1], [2]).status == TransferStatus.DONE
    finally:
        sender.close()
        recv.close()


def test_closing_the_sender_cancels_a_probe_in_progress(mode, probes_taken):
    _, entered, gate = probes_taken
    gate.clear()
    src, dst = caches(), caches(seed=1)
    recv, sender = receiver_of(dst), probing_sender("torch_dist", src)
    try:
        transfer(sender, recv, "r1", [0], [9])
        wait_for(entered.is_set, 20, "the probe at the receiver")
        start = time.monotonic()
        sender.close()  # no wait for the probe's 10 s timeout
        assert time.monotonic() - start < 2.0
        assert sender.link_gbps(recv.address) is None
    finally:
        gate.set()
        recv.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_bursts_are_timed_by_events_on_the_links_stream() -> None:
    """One GPU holds no NCCL pair: a group whose send copies on the current stream (where
    NCCL's `wait()` puts it) stands in. The first burst is slowed on the stream and untimed;
    the rate is of the others, and posting never blocks the host."""
    import itertools

    from duet.kv_transfer.torch_dist.channel import Channel
    from duet.kv_transfer.torch_dist.link import CudaMark
    from duet.kv_transfer.torch_dist.probe import ProbeJob, post_probe

    class CopyGroup:
        def __init__(self) -> None:
            self.out = torch.empty(PROBE_BYTES, dtype=torch.uint8, device="cuda")
            self.num_sends = 0

        def send(self, tensors, peer, tag):  # type: ignore[no-untyped-def]
            self.out.copy_(tensors[0])
            self.num_sends += 1
            if self.num_sends == 1:
                torch.cuda._sleep(100_000_000)  # ~50 ms on the stream
            return type("Work", (), {"wait": lambda self: True})()

    class Store:
        def queue_push(self, key: str, value: str) -> None:
            self.pushed = (key, value)

    device = torch.device("cuda")
    link = NcclLink(CopyGroup(), 1, device)
    channel = Channel("c", Store(), Store(), link, None, itertools.count(1))  # type: ignore[arg-type]
    payload = torch.zeros(PROBE_BYTES, dtype=torch.uint8, device=device)
    job = ProbeJob(channel, payload, [next(channel.tags) for _ in range(BURSTS)])
    start = time.monotonic()
    post_probe(job)
    assert time.monotonic() - start < 0.02  # the slow first burst did not block the host
    assert len(job.marks) == BURSTS and all(isinstance(m, CudaMark) for m in job.marks)
    assert job.sent is not None and job.sent.wait(10)
    assert job.gbps() > PROBE_BYTES / 0.01 / 1e9  # a device copy, not the 50 ms first burst


def test_a_failed_channel_is_not_reused_before_it_leaves_the_table(mode):
    """`connect` in the moment between a channel's failure and its removal from the table (the
    link's abort runs between them) opens a new channel instead of handing out the dead one."""
    src, dst = caches(), caches(seed=1)
    recv, sender = receiver_of(dst), probing_sender("torch_dist", src, measure_link=False)
    try:
        transfer(sender, recv, "r1", [0], [9])
        old = sender._open_channel(recv.address)
        old.failed = True  # as `_fail_channel` sets it first
        fresh = sender.connect(recv.address)
        assert fresh is not old and not fresh.failed
        assert transfer(sender, recv, "r2", [1], [2]).status == TransferStatus.DONE
        assert landed(src, dst, [0, 1], [9, 2])
    finally:
        sender.close()
        recv.close()
