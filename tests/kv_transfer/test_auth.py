"""KV channels' challenge-response (cluster_auth/handshake.py): a sender without the cluster
secret cannot open a channel or offer a block (the receiver's cache stays bitwise the same)
while a sender with it completes its transfer on the same receiver, over tcp and over
torch_dist's store rendezvous; on tcp, garbage, truncated and silent handshakes neither crash,
hang nor leak anything, and a receiver without the secret is refused by the sender."""

from __future__ import annotations

import logging
import os
import socket
import threading

import torch

from duet.cluster_auth import ClusterSecret
from duet.cluster_auth.handshake import MAGIC
from duet.kv_transfer import TransferStatus, create_receiver, create_sender
from tests.kv_transfer.paged import caches, layout
from tests.waiting import wait_for

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

SECRET = ClusterSecret("kv-right-" + "c" * 40)
OTHER = ClusterSecret("kv-wrong-" + "d" * 40)


def make_receiver(timeout_s=10.0, backend="tcp"):
    dst = caches(seed=1)
    recv = create_receiver(
        backend, kv_caches=dst, layout=layout(dst), timeout_s=timeout_s, secret=SECRET
    )
    return recv, dst


def send(src, recv, request_id, blocks, secret, name, backend="tcp"):
    """The sender's outcome; for a transfer that lands, the receiver's poll (the engine
    thread's) is what acknowledges it, so it is polled here too."""
    sender = create_sender(
        backend, kv_caches=src, layout=layout(src), name=name, timeout_s=10, secret=secret
    )
    sender.send(request_id, blocks, recv.address)
    landed = []
    try:
        [result] = wait_for(
            lambda: landed.extend(recv.poll()) or sender.poll(), 20, f"{name}'s outcome"
        )
    finally:
        sender.close()
    return result, landed


def test_a_sender_without_the_secret_is_refused_before_any_block_changes(caplog):
    recv, dst = make_receiver()
    src = caches()
    try:
        recv.expect("r1", [9, 3, 12], timeout_s=30)
        before = [c.clone() for c in dst]
        with caplog.at_level(logging.INFO):
            wrong, landed = send(src, recv, "r1", [0, 5, 7], OTHER, "intruder")
            assert landed == []
            bare, landed = send(src, recv, "r1", [0, 5, 7], None, "bare")  # no handshake at all
            assert landed == []
        assert (wrong.status, wrong.retryable) == (TransferStatus.FAILED, True)
        assert "different cluster secret" in wrong.error
        assert bare.status == TransferStatus.FAILED
        wait_for(lambda: recv.refusals.num_refused == 2, 10, "both refusals counted")
        assert recv.poll() == []
        assert all(torch.equal(b, c) for b, c in zip(before, dst, strict=True))
        assert recv._inbox == {} and recv._staging.high_water_bytes == 0  # nothing staged
        # logged once per address, never the secret
        refusals = [r for r in caplog.records if "refused a peer" in r.getMessage()]
        assert len(refusals) == 1 and "127.0.0.1" in refusals[0].getMessage()
        assert "c" * 40 not in caplog.text and "d" * 40 not in caplog.text
        # the cluster's own sender: its transfer completes on the same receiver
        result, [done] = send(src, recv, "r1", [0, 5, 7], SECRET, "prefill")
        assert (result.status, done.status) == (TransferStatus.DONE, TransferStatus.DONE)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[:, [9, 3, 12]], s[:, [0, 5, 7]])
    finally:
        recv.close()


def raw_peer(address):
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    challenge = sock.recv(64)
    assert challenge.startswith(MAGIC)
    return sock


def closed_by_peer(sock) -> bool:
    try:
        return sock.recv(64) == b""
    except ConnectionResetError:
        return True


def test_garbage_truncated_and_silent_handshakes_are_closed():
    recv, dst = make_receiver(timeout_s=1.0)
    src = caches()
    try:
        recv.expect("r2", [1, 2], timeout_s=30)
        before = [c.clone() for c in dst]
        garbage = raw_peer(recv.address)
        garbage.sendall(b"\xff" * 64)  # a full-size answer with a wrong proof
        assert closed_by_peer(garbage)
        truncated = raw_peer(recv.address)
        truncated.sendall(b"\x00" * 10)
        truncated.shutdown(socket.SHUT_WR)
        assert closed_by_peer(truncated)
        silent = raw_peer(recv.address)  # says nothing: closed at the receiver's timeout
        assert closed_by_peer(silent)
        for s in (garbage, truncated, silent):
            s.close()
        wait_for(lambda: recv.refusals.num_refused == 3, 10, "three refusals")
        assert all(torch.equal(b, c) for b, c in zip(before, dst, strict=True))
        assert recv._inbox == {} and recv._staging.high_water_bytes == 0  # nothing staged
        # the reservation is intact: the cluster's sender fills it
        result, [done] = send(src, recv, "r2", [4, 6], SECRET, "prefill")
        assert (result.status, done.status) == (TransferStatus.DONE, TransferStatus.DONE)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[:, [1, 2]], s[:, [4, 6]])
    finally:
        recv.close()


def test_the_sender_refuses_a_receiver_without_the_secret():
    listener = socket.create_server(("127.0.0.1", 0))
    got = []

    def impostor():
        sock, _ = listener.accept()
        with sock:
            sock.sendall(MAGIC + b"\x01" * 32)
            got.append(sock.recv(64))
            sock.sendall(b"\x02" * 32)  # not the receiver's proof
            sock.recv(1)

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    src = caches()
    sender = create_sender(
        "tcp", kv_caches=src, layout=layout(src), name="p", timeout_s=5, secret=SECRET
    )
    try:
        sender.send("r3", [0], f"127.0.0.1:{listener.getsockname()[1]}")
        [result] = wait_for(sender.poll, 20, "the sender's outcome")
        assert result.status == TransferStatus.FAILED
        assert "did not prove the cluster secret" in result.error
        assert len(got[0]) == 64 and b"c" * 40 not in got[0]  # a proof, not the secret
    finally:
        sender.close()
        listener.close()
        thread.join(timeout=10)


def test_torch_dist_rendezvous_refuses_a_sender_without_the_secret():
    recv, dst = make_receiver(backend="torch_dist")
    src = caches()
    try:
        recv.expect("r4", [2, 8], timeout_s=30)
        before = [c.clone() for c in dst]
        wrong, landed = send(src, recv, "r4", [1, 3], OTHER, "intruder", "torch_dist")
        assert (wrong.status, wrong.retryable, landed) == (TransferStatus.FAILED, True, [])
        assert "different cluster secret" in wrong.error
        assert recv.refusals.num_refused == 1
        assert recv._links == {}  # no link was opened for it
        assert all(torch.equal(b, c) for b, c in zip(before, dst, strict=True))
        result, [done] = send(src, recv, "r4", [1, 3], SECRET, "prefill", "torch_dist")
        assert (result.status, done.status) == (TransferStatus.DONE, TransferStatus.DONE)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[:, [2, 8]], s[:, [1, 3]])
    finally:
        recv.close()
