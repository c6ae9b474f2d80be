"""Vectored socket I/O between paged caches: rows in any order and more iovecs than one call
takes, partial sends and receives resumed where they stopped, and the errors a peer can cause."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from duet.kv_transfer import sockio


def connected_pair(buffer_bytes: int | None = None) -> tuple[socket.socket, socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.socket()
    if buffer_bytes is not None:  # small kernel buffers: calls end before all bytes moved
        for s in (client, server):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    client.connect(server.getsockname())
    accepted, _ = server.accept()
    server.close()
    return client, accepted


class CountingLibc:
    """Counts the sendmsg/recvmsg calls, so a test knows the partial paths ran."""

    def __init__(self, libc) -> None:
        self.libc = libc
        self.calls = {"sendmsg": 0, "recvmsg": 0}

    def __getattr__(self, name):
        fn = getattr(self.libc, name)
        if name not in self.calls:
            return fn

        def counted(*args):
            self.calls[name] += 1
            return fn(*args)

        return counted


def paged(seed: int, num_layers: int = 2, num_blocks: int = 1100) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, 2, 1, 6, generator=g) for _ in range(num_layers)]


def test_rows_in_any_order_beyond_iov_max_round_trip_bit_exact():
    src, dst = paged(0), paged(1)
    g = torch.Generator().manual_seed(2)
    src_rows = torch.randperm(2 * 1100, generator=g)[:1500]  # 2 x 1500 iovecs > IOV_MAX
    dst_rows = torch.randperm(2 * 1100, generator=g)[:1500]
    a, b = connected_pair()
    for s in (a, b):
        sockio.set_timeouts(s, 10)
    sender = threading.Thread(target=sockio.send_iovecs, args=(a, sockio.row_iovecs(src, src_rows)))
    sender.start()
    sockio.recv_iovecs(b, sockio.row_iovecs(dst, dst_rows))
    sender.join()
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d.view(2200, -1)[dst_rows], s.view(2200, -1)[src_rows])
    a.close(), b.close()


def test_partial_sends_and_receives_resume_where_they_stopped(monkeypatch):
    counting = CountingLibc(sockio._LIBC)
    monkeypatch.setattr(sockio, "_LIBC", counting)
    src, dst = paged(3, num_layers=1), paged(4, num_layers=1)
    rows = torch.randperm(2200, generator=torch.Generator().manual_seed(5))[:2000]
    a, b = connected_pair(buffer_bytes=4096)
    sockio.set_timeouts(a, 0.2)  # a blocked sendmsg returns what it moved after 0.2 s
    sockio.set_timeouts(b, 0.2)  # and so does a MSG_WAITALL recvmsg
    landed = torch.zeros(2000 * 48, dtype=torch.uint8)

    def slow_reader():  # reads a contiguous copy in small, slow bites
        view = memoryview(landed.numpy())
        got = 0
        while got < landed.numel():
            got += b.recv_into(view[got : got + 8192])
            time.sleep(0.03)

    reader = threading.Thread(target=slow_reader)
    reader.start()
    sockio.send_iovecs(a, sockio.row_iovecs(src, rows))
    reader.join()
    assert torch.equal(landed.view(torch.float32).view(2000, 12), src[0].view(2200, 12)[rows])
    assert counting.calls["sendmsg"] > 2  # 2 batches of iovecs, and partial sends resumed

    def slow_writer():  # a pause shorter than the timeout: every call gets some bytes
        data = landed.numpy().tobytes()
        for start in range(0, len(data), 8192):
            a.sendall(data[start : start + 8192])
            time.sleep(0.1)

    writer = threading.Thread(target=slow_writer)
    writer.start()
    sockio.recv_iovecs(b, sockio.row_iovecs(dst, rows))
    writer.join()
    assert torch.equal(dst[0].view(2200, 12)[rows], src[0].view(2200, 12)[rows])
    assert counting.calls["recvmsg"] > 2
    a.close(), b.close()


def test_peer_closing_mid_transfer_and_silence_are_errors():
    dst = paged(0, num_layers=1)
    rows = torch.arange(10)
    a, b = connected_pair()
    sockio.set_timeouts(b, 0.2)
    with pytest.raises(TimeoutError):
        sockio.recv_iovecs(b, sockio.row_iovecs(dst, rows))
    a.sendall(b"\x00" * 100)
    a.close()
    with pytest.raises(ConnectionError, match="closed the connection mid-transfer"):
        sockio.recv_iovecs(b, sockio.row_iovecs(dst, rows))
    b.close()


def test_iovecs_refuse_rows_outside_the_cache_and_strided_caches():
    kv = paged(0, num_layers=1, num_blocks=4)
    with pytest.raises(ValueError, match=r"rows: must be in \[0, 8\)"):
        sockio.row_iovecs(kv, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="contiguous CPU caches"):
        sockio.row_iovecs([kv[0].transpose(2, 4)], torch.tensor([0]))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        sockio.buffer_iovecs(kv[0].transpose(2, 4))


def test_rows_that_continue_each_other_become_one_iovec():
    kv = paged(0, num_layers=2, num_blocks=8)  # 16 rows of 48 bytes per layer
    iov = sockio.row_iovecs(kv, torch.tensor([2, 3, 4, 7, 10, 11]))
    base0, base1 = kv[0].data_ptr(), kv[1].data_ptr()
    assert iov.tolist() == [
        [base0 + 2 * 48, 3 * 48], [base0 + 7 * 48, 48], [base0 + 10 * 48, 2 * 48],
        [base1 + 2 * 48, 3 * 48], [base1 + 7 * 48, 48], [base1 + 10 * 48, 2 * 48],
    ]  # fmt: skip
    src, dst = paged(1, num_blocks=8), paged(2, num_blocks=8)
    rows = torch.tensor([0, 1, 2, 3, 9, 8, 12, 13])
    a, b = connected_pair()
    sender = threading.Thread(target=sockio.send_iovecs, args=(a, sockio.row_iovecs(src, rows)))
    sender.start()
    sockio.recv_iovecs(b, sockio.row_iovecs(dst, torch.arange(8)))
    sender.join()
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d.view(16, -1)[:8], s.view(16, -1)[rows])
    a.close(), b.close()


def test_split_iovecs_cuts_equal_shares_of_bytes_inside_iovecs_where_needed():
    iov = torch.tensor([[1000, 10], [2000, 7], [3000, 5]])  # 22 bytes
    parts = sockio.split_iovecs(iov, 3)  # 7, 7 and the remaining 8
    assert [p.tolist() for p in parts] == [
        [[1000, 7]],
        [[1007, 3], [2000, 4]],
        [[2004, 3], [3000, 5]],
    ]
    assert [p.tolist() for p in sockio.split_iovecs(iov, 2)] == [
        [[1000, 10], [2000, 1]],
        [[2001, 6], [3000, 5]],
    ]
    assert sockio.split_iovecs(iov, 1)[0].tolist() == iov.tolist()
    assert iov.tolist() == [[1000, 10], [2000, 7], [3000, 5]]  # the input is left as it was
    for bad in (0, 23):
        with pytest.raises(ValueError, match=r"parts: must be in \[1, 22\]"):
            sockio.split_iovecs(iov, bad)
