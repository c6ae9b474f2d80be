"""The tcp sender's link probe (kv_transfer/link_probe.py, kv_transfer/tcp/probe.py): it runs
once per receiver, after the first transfer there and alone on the link, its rate is its
bursts' bytes over their time, later results carry it, it gives up on a receiver that never
answers within the timeout, and neither a probe in progress nor one given up holds up a
transfer."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from duet.kv_transfer import TransferStatus, chunks, create_receiver
from duet.kv_transfer.link_probe import LinkProber
from duet.kv_transfer.outbox import Outbox
from duet.kv_transfer.tcp.probe import BURSTS, PROBE_BYTES_PER_STRIPE, TcpProbe
from duet.kv_transfer.tcp.receiver import TcpKVReceiver
from tests.kv_transfer.paged import caches, layout
from tests.kv_transfer.probing import held_calls, layerwise_transfer, probing_sender, transfer
from tests.waiting import wait_for

BURST_BYTES = 2 * PROBE_BYTES_PER_STRIPE  # over the sender's default 2 stripes


@pytest.fixture
def receiver():
    dst = caches(seed=1)
    recv = create_receiver("tcp", kv_caches=dst, layout=layout(dst), timeout_s=10)
    yield recv, dst
    recv.close()


@pytest.fixture
def drained(monkeypatch):
    """(nbytes, stripes) of every payload a receiver read and dropped (a probe's bursts), an
    event set at the first, and a gate they wait at while it is clear (up to 10 s)."""
    with held_calls(
        monkeypatch, TcpKVReceiver, "_drain", lambda channel, nbytes, stripes: (nbytes, stripes), 10
    ) as held:
        yield held


def test_the_probe_runs_once_after_the_first_transfer_and_later_results_carry_it(
    receiver, drained, monkeypatch
):
    recv, _ = receiver
    calls, _, _ = drained
    src = caches()
    sender = probing_sender("tcp", src)
    # The first transfer is open from its start to its report: the probe waits for it.
    first = transfer(sender, recv, "r1", [0, 5, 7], [9, 3, 12])
    assert (first.status, first.num_chunks, first.link_gbps) == (TransferStatus.DONE, 1, None)
    gbps = wait_for(lambda: sender.link_gbps(recv.address), 20, "the probed rate")
    assert gbps > 0
    assert calls == [(BURST_BYTES, 2)] * BURSTS  # its bursts, over both stripes
    # Layer-wise, a message per layer: 3 chunks, and the link's rate with them.
    monkeypatch.setattr(chunks, "CHUNK_MIN_BYTES", 1)
    second = layerwise_transfer(sender, recv, "r2", [4, 6], [1, 2], len(src))
    assert (second.status, second.num_chunks, second.link_gbps) == (TransferStatus.DONE, 3, gbps)
    assert transfer(sender, recv, "r3", [8], [0]).link_gbps == gbps
    assert len(calls) == BURSTS  # measured once
    sender.close()


def test_the_rate_is_the_bursts_bytes_over_their_time(receiver, monkeypatch):
    recv, _ = receiver
    real = TcpKVReceiver._drain

    def slow_drain(self, channel, nbytes, stripes):  # type: ignore[no-untyped-def]
        time.sleep(0.2)  # every burst takes at least this long
        return real(self, channel, nbytes, stripes)

    monkeypatch.setattr(TcpKVReceiver, "_drain", slow_drain)
    sender = probing_sender("tcp", caches(), measure_link=False)
    gbps = TcpProbe(lambda dest: sender._dial(dest)[0]).measure(recv.address)
    # 0.2 s a burst, less a round trip of well under 50 ms (a ping without payload is not
    # slowed); the upper bound on the time is only this busy machine's.
    assert BURST_BYTES / 5.0 / 1e9 < gbps < BURST_BYTES / 0.15 / 1e9
    sender.close()


@pytest.mark.parametrize("peer", ["silent", "no_pong"])
def test_a_probe_gives_up_on_a_receiver_that_never_answers(receiver, drained, peer):
    """`silent`: accepts connections and never says a word (the handshake's answer never
    comes); `no_pong`: a receiver that never finishes reading a burst."""
    recv, _ = receiver
    _, _, gate = drained
    listener = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
    address = f"127.0.0.1:{listener.getsockname()[1]}" if peer == "silent" else recv.address
    gate.clear()
    sender = probing_sender("tcp", caches(), measure_link=False, timeout_s=0.5)
    outbox = Outbox(ack_timeout_s=1.0)
    prober = LinkProber(TcpProbe(lambda dest: sender._dial(dest)[0]), outbox, "p0", 0.5)
    try:
        start = time.monotonic()
        prober.start(address)
        wait_for(lambda: not any(t.is_alive() for t in prober._threads), 10, "the probe's end")
        assert 0.5 <= time.monotonic() - start < 5.0  # one socket timeout, give or take
        assert outbox.link_gbps(address) is None
        prober.start(address)  # tried just now: not again before RETRY_S
        assert not any(t.is_alive() for t in prober._threads)
    finally:
        gate.set()
        prober.close()
        sender.close()
        listener.close()


def test_a_probe_in_progress_holds_up_no_transfer_and_a_try_it_overlapped_is_redone(
    receiver, drained
):
    recv, dst = receiver
    calls, entered, gate = drained
    gate.clear()
    src = caches()
    sender = probing_sender("tcp", src)
    transfer(sender, recv, "r1", [0], [9])
    wait_for(entered.is_set, 20, "the probe's first burst at the receiver")
    # The probe's burst is stuck at the receiver; a transfer goes through meanwhile, over its
    # own channel and threads, with no rate yet.
    second = transfer(sender, recv, "r2", [2], [1])
    assert (second.status, second.link_gbps) == (TransferStatus.DONE, None)
    assert all(torch.equal(d[:, 1], s[:, 2]) for s, d in zip(src, dst, strict=True))
    gate.set()
    # The try that r2 overlapped is thrown away; the next one, alone on the link, counts.
    assert wait_for(lambda: sender.link_gbps(recv.address), 20, "the probed rate") > 0
    assert calls == [(BURST_BYTES, 2)] * (2 * BURSTS)
    sender.close()


def test_closing_the_sender_cancels_a_probe_in_progress(receiver, drained):
    recv, _ = receiver
    _, entered, gate = drained
    gate.clear()
    sender = probing_sender("tcp", caches())
    transfer(sender, recv, "r1", [0], [9])
    wait_for(entered.is_set, 20, "the probe's first burst at the receiver")
    start = time.monotonic()
    sender.close()  # its probe's connections are shut down: no wait for its 10 s timeout
    assert time.monotonic() - start < 2.0
    assert sender.link_gbps(recv.address) is None
