"""The tcp backend's own behaviour: KV lands straight in the reserved blocks (no staging) when
expected, in a slot of the staging pool when not; a write in progress holds off abort and timeouts and is
cut off when it stalls; the sender reports a transfer only once its thread let go of the
blocks; a broken connection fails its transfers retryable and is replaced; `auto` picks it for
CPU caches. (What every backend does is in test_channels.py.)"""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import termios
import threading
import time

import pytest
import torch

from duet.kv_transfer import TransferStatus, create_receiver, create_sender
from duet.kv_transfer.factory import resolve_backend
from duet.kv_transfer.tcp import receiver as tcp_receiver
from duet.kv_transfer.tcp.stripes import MAX_STRIPES
from tests.kv_transfer.paged import caches, layout
from tests.waiting import wait_for

# caches(): 3 layers of [2, 16 blocks, 4 tokens, 4 heads, 8] fp32: a block row is 512 bytes
ROW_BYTES = 4 * 4 * 8 * 4


@pytest.fixture
def receiver():
    dst = caches(seed=1)
    recv = create_receiver("tcp", kv_caches=dst, layout=layout(dst), timeout_s=10)
    yield recv, dst
    recv.close()


def test_expected_kv_lands_in_the_reserved_blocks_without_staging(receiver):
    recv, dst = receiver
    src = caches()
    sender = create_sender("tcp", kv_caches=src, layout=layout(src), name="p0", timeout_s=10)
    recv.expect("r1", [9, 3, 12], timeout_s=10)
    sender.send("r1", [0, 5, 7], recv.address, meta={"first_token": 3})
    [done] = wait_for(recv.poll, 20, "recv.poll")
    assert (done.status, done.meta) == (TransferStatus.DONE, {"first_token": 3})
    assert [r.status for r in wait_for(sender.poll, 20, "sender.poll")] == [TransferStatus.DONE]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, [9, 3, 12]], s[:, [0, 5, 7]])
    assert recv._staging.high_water_bytes == 0  # no slot was ever taken
    sender.close()


def test_kv_before_expect_is_staged_then_written(receiver):
    recv, dst = receiver
    src = caches()
    sender = create_sender("tcp", kv_caches=src, layout=layout(src), name="p0", timeout_s=10)
    sender.send("early", [1, 2], recv.address)
    wait_for(
        lambda: "early" in recv._inbox and len(recv._inbox["early"][0].landed) == 1,
        10,
        "the early transfer staged (one piece: 3 layers of 2 blocks)",
    )
    assert recv._staging.used_bytes == 3 * 2 * 2 * ROW_BYTES
    assert recv.poll() == []  # nobody expects it yet
    recv.expect("early", [14, 0], timeout_s=10)
    assert [r.status for r in wait_for(recv.poll, 20, "recv.poll")] == [TransferStatus.DONE]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, [14, 0]], s[:, [1, 2]])
    assert recv._staging.used_bytes == 0  # its slot, back in the pool
    assert [r.status for r in wait_for(sender.poll, 20, "sender.poll")] == [TransferStatus.DONE]
    sender.close()


class FakeSender:
    """A peer speaking the tcp backend's protocol by hand, to stall or break it mid-frame."""

    def __init__(self, address: str, kv: list[torch.Tensor]) -> None:
        host, port = address.rsplit(":", 1)
        self.endpoint = (host, int(port))
        self.sock = socket.create_connection(self.endpoint, timeout=10)
        self.frame({"layout": layout(kv).to_dict()})
        verdict = self.answer(self.sock)["verdict"]
        assert "layout" in verdict
        self.token = verdict["channel"]

    def attach(self, index: int, token: str | None = None) -> socket.socket:
        """A further connection of the channel: its stripe `index`."""
        conn = socket.create_connection(self.endpoint, timeout=10)
        self.frame({"attach": token or self.token, "stripe": index}, sock=conn)
        return conn

    def frame(self, header: dict, payload: bytes = b"", sock: socket.socket | None = None) -> None:
        body = json.dumps(header).encode()
        (sock or self.sock).sendall(struct.pack("!I", len(body)) + body + payload)

    def answer(self, sock: socket.socket) -> dict:
        (length,) = struct.unpack("!I", self.read(4, sock))
        return json.loads(self.read(length, sock))

    def read(self, n: int, sock: socket.socket | None = None) -> bytes:
        data = b""
        while len(data) < n:
            chunk = (sock or self.sock).recv(n - len(data))
            assert chunk, "receiver closed"
            data += chunk
        return data


def send_fails(sock: socket.socket, nbytes: int) -> bool:
    """Whether sending `nbytes` on `sock` fails: the peer shut the connection."""
    try:
        sock.sendall(b"\x01" * nbytes)
    except OSError:
        return True
    return False


def test_abort_waits_out_a_stalled_write_then_cuts_it_off(receiver, monkeypatch):
    monkeypatch.setattr(tcp_receiver, "ABORT_WAIT_S", 0.3)
    recv, dst = receiver
    before = [c.clone() for c in dst]
    fake = FakeSender(recv.address, dst)
    recv.expect("r1", [4, 6], timeout_s=10)
    fake.frame({"type": "xfer", "request_id": "r1", "num_blocks": 2, "meta": {}, "trailer": False})
    nbytes = 3 * 4 * ROW_BYTES  # 3 layers of K and V rows of 2 blocks
    # Half of layer 0's K row of block 4, then the sender stalls mid-write.
    fake.frame(
        {"type": "kv", "request_id": "r1", "piece": [0, 3, 0, 2], "nbytes": nbytes},
        b"\x00" * (ROW_BYTES // 2),
    )
    wait_for(lambda: "r1" in recv._writing, 10, "the receiver writing r1")
    assert recv.poll() == []  # written into: not done, not timed out
    started = time.monotonic()
    recv.abort("r1")
    assert 0.3 <= time.monotonic() - started < 5  # waited, then shut the connection
    assert "r1" not in recv._writing
    assert [r.status for r in recv.poll()] == [TransferStatus.ABORTED]
    # The connection is gone: nothing more can land.
    wait_for(lambda: send_fails(fake.sock, nbytes), 10, "the receiver to shut the connection")
    # Only the half row that came before the abort was written; every other byte is as it was.
    k0 = dst[0][0, 4].view(-1).view(torch.uint8)
    assert torch.equal(
        k0[ROW_BYTES // 2 :], before[0][0, 4].view(-1).view(torch.uint8)[ROW_BYTES // 2 :]
    )
    dst[0][0, 4] = before[0][0, 4]
    assert all(torch.equal(a, b) for a, b in zip(before, dst, strict=True))


@pytest.mark.parametrize(
    "bad",
    [
        {"nbytes": 5},  # not the size of 3 layers of one block
        {"nbytes": 3 * 2 * ROW_BYTES, "piece": [0, 3, 0, 2]},  # blocks the transfer lacks
        {"nbytes": 3 * 2 * ROW_BYTES, "stripes": 2},  # more stripes than the channel has
    ],
)
def test_a_malformed_frame_breaks_the_channel_and_fails_retryable(receiver, bad):
    recv, dst = receiver
    fake = FakeSender(recv.address, dst)
    recv.expect("r1", [4], timeout_s=10)
    fake.frame({"type": "xfer", "request_id": "r1", "num_blocks": 1, "meta": {}, "trailer": False})
    fake.frame({"type": "kv", "request_id": "r1", "piece": [0, 3, 0, 1], **bad})
    [result] = wait_for(recv.poll, 20, "recv.poll")
    assert result.status == TransferStatus.FAILED and result.retryable
    assert "sender lost" in result.error
    assert fake.sock.recv(1) == b""  # the receiver closed the connection


def test_a_stripe_attaches_only_to_a_live_channel_in_order(receiver):
    recv, dst = receiver
    fake = FakeSender(recv.address, dst)
    for index, token in ((1, "no-such-channel"), (2, None)):  # unknown channel; a gap
        refused = fake.attach(index, token)
        assert refused.recv(1) == b""  # closed without an answer
        refused.close()
    good = fake.attach(1)
    assert fake.answer(good) == {"attached": 1}
    good.close()


def test_a_striped_payload_lands_and_an_abort_cuts_every_stripe(receiver, monkeypatch):
    """A kv frame over two connections: each carries its share of the bytes (the first half on
    the first, the rest on the second), written into the reserved rows. A stripe that stalls
    mid-share holds the abort for ABORT_WAIT_S; then both connections are shut."""
    monkeypatch.setattr(tcp_receiver, "ABORT_WAIT_S", 0.3)
    recv, dst = receiver
    fake = FakeSender(recv.address, dst)
    second = fake.attach(1)
    assert fake.answer(second) == {"attached": 1}
    src = caches(seed=7)
    recv.expect("r1", [4, 6], timeout_s=10)
    fake.frame({"type": "xfer", "request_id": "r1", "num_blocks": 2, "meta": {}, "trailer": False})
    # The sender's rows for its blocks 3 and 9 (K rows, then V rows, layer by layer).
    payload = b"".join(
        c.view(2 * c.shape[1], -1)[[3, 9, 3 + c.shape[1], 9 + c.shape[1]]].numpy().tobytes()
        for c in src
    )
    half = len(payload) // 2
    header = {"type": "kv", "request_id": "r1", "piece": [0, 3, 0, 2], "nbytes": len(payload)}
    fake.frame({**header, "stripes": 2}, payload[:half])
    second.sendall(payload[half:])
    assert [r.status for r in wait_for(recv.poll, 20, "recv.poll")] == [TransferStatus.DONE]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, [4, 6]], s[:, [3, 9]])

    before = [c.clone() for c in dst]
    recv.expect("r2", [1, 2], timeout_s=10)
    fake.frame({"type": "xfer", "request_id": "r2", "num_blocks": 2, "meta": {}, "trailer": False})
    fake.frame({**header, "request_id": "r2", "stripes": 2}, payload[:half])
    second.sendall(payload[half : half + ROW_BYTES])  # the second share stalls
    wait_for(lambda: "r2" in recv._writing, 10, "the receiver writing r2")
    started = time.monotonic()
    recv.abort("r2")
    assert 0.3 <= time.monotonic() - started < 5
    assert [r.status for r in recv.poll()] == [TransferStatus.ABORTED]
    for conn in (fake.sock, second):  # both connections are gone
        wait_for(lambda c=conn: send_fails(c, len(payload)), 10, "the receiver to shut it")
    # Blocks 1 and 2 got the first share and one row of the second; no other block changed.
    others = [b for b in range(dst[0].shape[1]) if b not in (1, 2)]
    assert all(torch.equal(a[:, others], b[:, others]) for a, b in zip(before, dst, strict=True))
    second.close()


class StalledReceiver:
    """Accepts one channel of `stripes` connections, answers the handshake and the attaches,
    then never reads."""

    def __init__(self, stripes: int = 2) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.stripes = stripes
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._handshake)
        self.thread.start()

    @staticmethod
    def _exchange(conn: socket.socket, answer) -> dict:
        (length,) = struct.unpack("!I", conn.recv(4, socket.MSG_WAITALL))
        hello = json.loads(conn.recv(length, socket.MSG_WAITALL))
        body = json.dumps(answer(hello)).encode()
        conn.sendall(struct.pack("!I", len(body)) + body)
        return hello

    @staticmethod
    def _verdict(hello: dict) -> dict:
        return {"verdict": {"layout": hello["layout"], "channel": "c", "max_piece_bytes": 64 << 20}}

    def _handshake(self) -> None:
        for index in range(self.stripes):
            conn, _ = self.server.accept()
            self.conns.append(conn)
            if index == 0:
                self._exchange(conn, self._verdict)
            else:
                self._exchange(conn, lambda h: {"attached": h["stripe"]})

    def queued_bytes(self) -> int:
        """Bytes that arrived on the accepted connections and were not read (Linux FIONREAD)."""
        return sum(
            struct.unpack("i", fcntl.ioctl(conn, termios.FIONREAD, b"\0" * 4))[0]
            for conn in list(self.conns)
        )

    def close(self) -> None:
        self.thread.join(10)
        for conn in self.conns:
            conn.close()
        self.server.close()


def big_caches() -> list[torch.Tensor]:
    return [torch.ones(2, 64, 16, 16, 64) for _ in range(2)]  # 4 MiB per layer and K/V


def test_sender_reports_abort_only_after_its_thread_let_go_of_the_blocks():
    """The receiver stops reading: the send thread is stuck in sendmsg, so an aborted transfer
    is not reported (its blocks are still being read) until the connection breaks."""
    big = big_caches()
    peer = StalledReceiver()
    sender = create_sender("tcp", kv_caches=big, layout=layout(big, 16), name="p0", timeout_s=10)
    sender.send("r1", list(range(64)), peer.address)
    # Once payload bytes arrive, the send thread is moving the whole 16 MiB in one go (a send
    # is one chunk), which the loopback buffers cannot take: it blocks and sees no abort.
    wait_for(lambda: peer.queued_bytes() > 4096, 10, "the KV payload to reach the peer")
    sender.abort("r1")
    for _ in range(20):  # lets time pass on purpose: no report comes while the thread is stuck
        assert sender.poll() == []
        time.sleep(0.02)
    peer.close()  # the connection breaks: the send fails, the thread lets go
    [result] = wait_for(sender.poll, 20, "sender.poll")
    assert result.status == TransferStatus.ABORTED  # the first word stands
    sender.close()


def test_a_receiver_gone_mid_transfer_fails_it_retryable():
    big = big_caches()
    peer = StalledReceiver()
    sender = create_sender("tcp", kv_caches=big, layout=layout(big, 16), name="p0", timeout_s=10)
    sender.send("r1", list(range(64)), peer.address)
    wait_for(lambda: peer.queued_bytes() > 4096, 10, "the KV payload to reach the peer")
    peer.close()
    [result] = wait_for(sender.poll, 20, "sender.poll")
    assert result.status == TransferStatus.FAILED and result.retryable
    sender.close()


def test_a_connection_the_receiver_closed_is_replaced_by_the_next_send(receiver):
    recv, dst = receiver
    src = caches()
    sender = create_sender("tcp", kv_caches=src, layout=layout(src), name="p0", timeout_s=10)
    recv.expect("r1", [2], timeout_s=10)
    sender.send("r1", [3], recv.address)
    assert [r.status for r in wait_for(recv.poll, 20, "recv.poll")] == [TransferStatus.DONE]
    assert [r.status for r in wait_for(sender.poll, 20, "sender.poll")] == [TransferStatus.DONE]
    first = sender.connect(recv.address)
    for channel in list(recv._channels):  # the decode side drops the connection ...
        channel.shutdown()
    recv.expect("r2", [5], timeout_s=10)  # ... and the next send opens a new one
    sender.send("r2", [1], recv.address)
    assert [r.status for r in wait_for(recv.poll, 20, "recv.poll")] == [TransferStatus.DONE]
    assert [r.status for r in wait_for(sender.poll, 20, "sender.poll")] == [TransferStatus.DONE]
    assert all(torch.equal(d[:, 5], s[:, 1]) for s, d in zip(src, dst, strict=True))
    assert sender.connect(recv.address) is not first
    sender.close()


def test_auto_picks_tcp_for_contiguous_cpu_caches_and_tcp_refuses_others():
    kv = caches()
    assert resolve_backend("auto", kv) == "tcp"
    strided = [c.transpose(3, 4) for c in kv]  # not contiguous
    assert resolve_backend("auto", strided) == "torch_dist"
    assert resolve_backend("torch_dist", kv) == "torch_dist"
    with pytest.raises(ValueError, match="kv_backend 'tcp': moves contiguous CPU caches only"):
        create_receiver("tcp", kv_caches=strided, layout=layout(kv))
    with pytest.raises(ValueError, match="kv_backend: unknown 'udp'"):
        resolve_backend("udp", kv)
    for stripes in (0, MAX_STRIPES + 1):
        with pytest.raises(ValueError, match=r"stripes: must be in \[1, 16\]"):
            create_sender("tcp", kv_caches=kv, layout=layout(kv), stripes=stripes)
