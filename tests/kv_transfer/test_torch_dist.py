"""torch_dist's own behaviour, under plain gloo and under NCCL's semantics (`nccl_emu.py`):
staging through reused buffers, several requests of one pass sharing a channel (NCCL matches
messages in issue order), chunks reported only once their event completed, and a peer lost
mid-transfer failing only its channel's requests within the transfer timeout. (What every
inter-process backend does is in test_channels.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from duet.kv_transfer import HandshakeError, TransferStatus, chunks, create_receiver, create_sender
from duet.kv_transfer.torch_dist.channel import sender_order
from tests.kv_transfer.paged import caches, layout
from tests.waiting import wait_for

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

TIMEOUT_S = 2.0  # the transfer timeout in the tests of a lost peer


@pytest.fixture(params=["gloo", "nccl-emulated"])
def mode(request, monkeypatch):
    """Both sides (and any peer process, which inherits the environment) in the same mode."""
    monkeypatch.setenv("DUET_KV_EMULATE_NCCL", "1" if request.param == "nccl-emulated" else "0")
    return request.param


def test_layer_by_layer_pieces_land_bit_exact_through_the_staging_pools(mode, monkeypatch):
    dst = caches(seed=1)
    recv = create_receiver("torch_dist", kv_caches=dst, layout=layout(dst), timeout_s=10)
    try:
        _check_chunks(recv, dst, monkeypatch)
    finally:
        recv.close()


def _check_chunks(recv, dst, monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK_MIN_BYTES", 1)  # one message per layer
    src = caches()
    sender = create_sender("torch_dist", kv_caches=src, layout=layout(src), name="p0", timeout_s=10)
    piece_bytes = 2 * 3 * 4 * 4 * 8 * 4  # [1, 2, n, BS, H, D] fp32: one layer of 3 blocks
    for attempt, (src_ids, dst_ids) in enumerate([([0, 5, 7], [9, 3, 12]), ([1, 2], [4, 6])]):
        recv.expect(f"r{attempt}", dst_ids, timeout_s=10)
        sender.send(f"r{attempt}", src_ids, recv.address)
        assert [r.status for r in wait_for(recv.poll, 20, "recv.poll")] == [TransferStatus.DONE]
        assert [r.status for r in wait_for(sender.poll, 20, "sender.poll")] == [TransferStatus.DONE]
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[:, dst_ids], s[:, src_ids])
        # Both sides staged each layer in a slot of their pool, every one given back after.
        for pool in (sender._staging, recv._staging):
            wait_for(lambda pool=pool: pool.used_bytes == 0, 20, "every slot back")
            assert 0 < pool.high_water_bytes <= 3 * piece_bytes
    sender.close()


def test_a_bad_emulation_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("DUET_KV_EMULATE_NCCL", "yes")
    src = caches()
    with pytest.raises(ValueError, match=r"^DUET_KV_EMULATE_NCCL: must be 0 or 1, got 'yes'$"):
        create_sender("torch_dist", kv_caches=src, layout=layout(src))


def test_sides_that_disagree_on_the_emulation_are_refused_at_the_handshake():
    dst = caches(seed=1)
    recv = create_receiver("torch_dist", dst, layout(dst), timeout_s=10, emulate_nccl=True)
    src = caches()
    sender = create_sender("torch_dist", src, layout(src), timeout_s=10, emulate_nccl=False)
    try:
        with pytest.raises(HandshakeError, match="link: sender 'gloo' != receiver 'nccl-emulated'"):
            sender.send("r", [0], recv.address)
    finally:
        sender.close()
        recv.close()


@pytest.mark.parametrize(
    ("order", "error"),
    [
        ([[0, 1], [0, 0]], "order: chunk 1 of transfer 0 out of place"),
        ([[0, 0], [1, 0]], "order: chunk 0 of transfer 1 out of place"),
        ([[0, 0]], r"order: chunks \[1\] of \[2\] listed"),
    ],
)
def test_a_header_order_the_receiver_cannot_follow_is_refused(order, error):
    header = {"transfers": [{"chunks": [[0, 1, 1], [1, 3, 2]]}], "order": order}
    with pytest.raises(ValueError, match=error):
        sender_order(header)


def collect(poll, count: int, what: str) -> list:
    """`count` results from `poll`, however many calls they take."""
    results: list = []
    while len(results) < count:
        results += wait_for(poll, 20, what)
    return results


@pytest.mark.parametrize(
    "plan",
    [
        # request -> (sender blocks, receiver blocks): 3 blocks go in 3 chunks (one layer each),
        # 1 block in one chunk of all 3 layers, 2 blocks in chunks of 2 layers and 1 layer.
        {"a": ([0, 5, 7], [9, 3, 12]), "b": ([1, 2, 4], [6, 8, 10])},
        {"a": ([2], [1]), "b": ([0, 5, 7], [9, 3, 12]), "c": ([8, 11], [14, 0])},
    ],
    ids=["two-equal", "three-unequal"],
)
def test_requests_finishing_in_one_pass_each_get_their_own_kv(mode, plan, monkeypatch):
    """The sender ships a pass's chunks layer-first across requests (a0, b0, a1, ...): NCCL
    matches them in issue order, so the receiver must post its receives in exactly that order
    (per request it would put one request's bytes into another's blocks, or hang when sizes
    differ)."""
    monkeypatch.setattr(chunks, "CHUNK_MIN_BYTES", 3000)  # bytes per layer: 1024 per block
    dst = caches(seed=1)
    recv = create_receiver("torch_dist", kv_caches=dst, layout=layout(dst), timeout_s=10)
    src = [torch.zeros_like(c) for c in caches()]  # the pass fills a layer at a time
    final = caches(seed=5)
    sender = create_sender("torch_dist", kv_caches=src, layout=layout(src), name="p0", timeout_s=10)
    try:
        for rid, (src_ids, dst_ids) in plan.items():
            recv.expect(rid, dst_ids, timeout_s=10)
            assert sender.begin(rid, src_ids, recv.address)
        for layer in range(len(src)):
            src[layer].copy_(final[layer])
            sender.layer_computed(layer)
        for token, rid in enumerate(plan):
            sender.finish(rid, {"first_token": token})
        results = collect(recv.poll, len(plan), "recv.poll")
        assert sorted((r.request_id, r.status, r.meta) for r in results) == [
            (rid, TransferStatus.DONE, {"first_token": token}) for token, rid in enumerate(plan)
        ]
        for rid, (src_ids, dst_ids) in plan.items():
            for layer, (f, d) in enumerate(zip(final, dst, strict=True)):
                assert torch.equal(d[:, dst_ids], f[:, src_ids]), f"{rid}: layer {layer}"
        acked = collect(sender.poll, len(plan), "sender.poll")
        assert sorted((r.request_id, r.status) for r in acked) == [
            (rid, TransferStatus.DONE) for rid in sorted(plan)
        ]
    finally:
        sender.close()
        recv.close()


def test_a_chunk_is_reported_only_once_its_event_completed(mode, monkeypatch):
    """NCCL's `wait()` returns before the data landed: the receiver must learn it from the
    event recorded after the receive. Its link holds every landing here (the bytes came in,
    the event stays pending): nothing is reported or written until the link lets go."""
    monkeypatch.setattr(chunks, "CHUNK_MIN_BYTES", 1)  # one message per layer
    dst = caches(seed=1)
    before = [c.clone() for c in dst]
    recv = create_receiver("torch_dist", kv_caches=dst, layout=layout(dst), timeout_s=10)
    src = caches()
    sender = create_sender("torch_dist", kv_caches=src, layout=layout(src), name="p0", timeout_s=10)
    try:
        sender.connect(recv.address)
        [link] = wait_for(lambda: list(recv._links.values()), 20, "the receiver's link")
        link.hold()
        recv.expect("r", [9, 3, 12], timeout_s=10)
        sender.send("r", [0, 5, 7], recv.address, meta={"first_token": 3})
        [arrival] = wait_for(lambda: recv._inbox.get("r"), 20, "the transfer delivered")
        deadline = time.monotonic() + 0.5  # the bytes come in meanwhile; their events wait
        while time.monotonic() < deadline:
            assert recv.poll() == []
            assert arrival.landed == [] and arrival.num_written == 0
            assert all(torch.equal(a, b) for a, b in zip(before, dst, strict=True))
            time.sleep(0.01)
        link.release()
        [done] = wait_for(recv.poll, 20, "recv.poll")
        assert (done.status, done.meta) == (TransferStatus.DONE, {"first_token": 3})
        assert all(
            torch.equal(d[:, [9, 3, 12]], s[:, [0, 5, 7]]) for s, d in zip(src, dst, strict=True)
        )
    finally:
        sender.close()
        recv.close()


DOOMED_SENDER = """
import os, sys, time
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
from duet.kv_transfer import chunks, create_sender
from tests.kv_transfer.paged import caches, layout
chunks.CHUNK_MIN_BYTES = 1  # one message per layer
kv = caches()
s = create_sender("torch_dist", kv, layout(kv), name="doomed", timeout_s=30)
s.begin("doomed", [0, 5, 7], sys.argv[1])
s.layer_computed(0)  # the header and layer 0 go out; the process dies before layer 1
print("sent", flush=True)
time.sleep(120)
"""


def peer_process(script: str, *args: str) -> subprocess.Popen[str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["DUET_CPU_KERNELS"] = "0"  # the peer scatters nothing: no kernel build to wait for
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, env=env
    )


def test_a_sender_killed_mid_transfer_fails_its_channel_within_the_timeout(mode, monkeypatch):
    """NCCL raises nothing when the peer dies: the receiver bounds each of the channel's
    operations by its timeout, aborts that channel and fails its request (retryable) long
    before the request's own deadline; another channel keeps working meanwhile and after."""
    monkeypatch.setattr(chunks, "CHUNK_MIN_BYTES", 1)
    dst = caches(seed=1)
    recv = create_receiver("torch_dist", kv_caches=dst, layout=layout(dst), timeout_s=TIMEOUT_S)
    src = caches()
    sender = create_sender("torch_dist", kv_caches=src, layout=layout(src), name="p0", timeout_s=10)
    proc = peer_process(DOOMED_SENDER, recv.address)
    try:
        recv.expect("doomed", [9, 3, 12], timeout_s=60)  # far beyond the transfer timeout
        assert proc.stdout is not None and proc.stdout.readline().strip() == "sent"
        wait_for(lambda: recv._inbox.get("doomed"), 20, "the doomed transfer delivered")
        proc.kill()
        proc.wait(10)
        killed = time.monotonic()
        recv.expect("live", [1, 2], timeout_s=60)
        sender.send("live", [4, 6], recv.address, meta={"first_token": 5})
        results = collect(recv.poll, 2, "recv.poll")
        took = time.monotonic() - killed
        by_id = {r.request_id: r for r in results}
        assert (by_id["live"].status, by_id["live"].meta) == (
            TransferStatus.DONE,
            {"first_token": 5},
        )
        assert (by_id["doomed"].status, by_id["doomed"].retryable) == (TransferStatus.FAILED, True)
        assert took < TIMEOUT_S + 3.0, f"failed after {took:.1f}s"
        assert all(torch.equal(d[:, [1, 2]], s[:, [4, 6]]) for s, d in zip(src, dst, strict=True))
        # The process keeps working: another transfer on the live channel.
        recv.expect("after", [5], timeout_s=60)
        sender.send("after", [3], recv.address)
        assert [r.status for r in wait_for(recv.poll, 20, "recv.poll")] == [TransferStatus.DONE]
    finally:
        proc.kill()
        sender.close()
        recv.close()


DOOMED_RECEIVER = """
import os, sys, time
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
from duet.kv_transfer import create_receiver
from tests.kv_transfer.paged import caches, layout
kv = caches(seed=1)
r = create_receiver("torch_dist", kv, layout(kv), timeout_s=30)
print(r.address, flush=True)
time.sleep(120)
"""


def test_a_receiver_that_stops_reading_fails_only_its_sends(mode):
    """A receiver stopped (SIGSTOP) with a transfer larger than the sockets can hold on its
    way: the send never completes and nothing raises (NCCL's sends wait for the receiver), yet
    the transfer fails retryable within the transfer timeout (not the 60 s hold lease), and
    the send thread meanwhile serves another channel, whose transfer completes."""
    big = [torch.zeros(2, 32768, 4, 4, 8) for _ in range(3)]  # 96 MiB: past any socket buffer
    for layer in big:
        layer[:, [4, 6]] = torch.randn(2, 2, 4, 4, 8)
    dst = caches(seed=1)
    live = create_receiver("torch_dist", kv_caches=dst, layout=layout(dst), timeout_s=10)
    sender = create_sender(
        "torch_dist", big, layout(big), name="p0", timeout_s=TIMEOUT_S, ack_timeout_s=60
    )
    proc = peer_process(DOOMED_RECEIVER)
    try:
        assert proc.stdout is not None
        stopped = proc.stdout.readline().strip()
        sender.connect(stopped)
        os.kill(proc.pid, signal.SIGSTOP)
        halted = time.monotonic()
        sender.send("doomed", list(range(32768)), stopped)
        live.expect("live", [1, 2], timeout_s=60)
        sender.send("live", [4, 6], live.address, meta={"first_token": 1})
        received, results = [], []

        def both_reported() -> bool:  # the live receiver's poll writes and acknowledges
            received.extend(live.poll())
            results.extend(sender.poll())
            return len(results) == 2

        wait_for(both_reported, 20, "both transfers reported")
        took = time.monotonic() - halted
        assert sorted((r.request_id, r.status, r.retryable) for r in results) == [
            ("doomed", TransferStatus.FAILED, True),
            ("live", TransferStatus.DONE, False),
        ]
        assert took < TIMEOUT_S + 3.0, f"failed after {took:.1f}s"
        assert [(r.request_id, r.status) for r in received] == [("live", TransferStatus.DONE)]
        assert all(torch.equal(d[:, [1, 2]], b[:, [4, 6]]) for b, d in zip(big, dst, strict=True))
        live.expect("after", [5], timeout_s=60)
        sender.send("after", [3], live.address)
        done = wait_for(live.poll, 20, "live.poll")
        assert [(r.request_id, r.status) for r in done] == [("after", TransferStatus.DONE)]
        acked = wait_for(sender.poll, 20, "sender.poll")
        assert [(r.request_id, r.status) for r in acked] == [("after", TransferStatus.DONE)]
    finally:
        proc.kill()
        sender.close()
        live.close()


def test_kv_links_keep_the_process_up_on_an_nccl_timeout(monkeypatch) -> None:
    """TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (abort the communicator, keep the process) unless the
    operator chose; set by every torch_dist sender and receiver before its links exist."""
    from duet.kv_transfer.torch_dist.link import set_nccl_error_handling

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    set_nccl_error_handling()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    set_nccl_error_handling()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
