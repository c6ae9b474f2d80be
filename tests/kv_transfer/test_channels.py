"""What every inter-process KV backend (torch_dist over gloo, tcp) does on loopback: handshake,
transfer, layer-wise sending, heterogeneous TP, abort, timeouts, and a sender process killed
mid-transfer."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest
import torch

from duet.kv_transfer import (
    HandshakeError,
    TransferStatus,
    chunks,
    create_receiver,
    create_sender,
)
from duet.kv_transfer.layout import KV_LAYOUT_VERSION
from duet.kv_transfer.tcp import stripes
from tests.kv_transfer.paged import caches, layout
from tests.waiting import wait_for

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

BACKENDS = ["torch_dist", "torch_dist-nccl-emulated", "tcp", "tcp-striped", "nixl", "nixl-push"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    if request.param == "tcp-striped":  # every payload split over the channel's 2 connections
        monkeypatch.setattr(stripes, "STRIPE_MIN_BYTES", 1)
        return "tcp"
    if request.param == "torch_dist-nccl-emulated":  # peer processes inherit the environment
        monkeypatch.setenv("DUET_KV_EMULATE_NCCL", "1")
        return "torch_dist"
    if request.param == "nixl-push":  # the sender writes into the receiver's blocks
        monkeypatch.setenv("DUET_KV_NIXL_MODE", "push")
        return "nixl"
    return request.param


@pytest.fixture
def receiver(backend):
    dst = caches(seed=1)
    recv = create_receiver(backend, kv_caches=dst, layout=layout(dst), timeout_s=10)
    yield recv, dst
    recv.close()


def test_transfer_is_bit_exact_and_acknowledged(receiver, backend):
    recv, dst = receiver
    src = caches()
    sender = create_sender(backend, kv_caches=src, layout=layout(src), name="p0", timeout_s=10)
    recv.expect("r1", [9, 3, 12], timeout_s=10)
    sender.send("r1", [0, 5, 7], recv.address)
    [done] = wait_for(recv.poll, 20, "recv.poll")
    assert done.status == TransferStatus.DONE
    [acked] = wait_for(sender.poll, 20, "sender.poll")
    # 3 layers of 3 blocks (3 KiB a layer) make one message, under `chunks.CHUNK_MIN_BYTES`;
    # no link rate: the probe is off unless the sender measures (`measure_link`)
    assert (acked.status, acked.num_chunks, acked.link_gbps) == (TransferStatus.DONE, 1, None)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, [9, 3, 12]], s[:, [0, 5, 7]])
    if backend == "tcp":  # the channel's connections: the sender's default of two
        assert len(sender.connect(recv.address).stripes.socks) == 2
    # A second request reuses the channel.
    recv.expect("r2", [1], timeout_s=10)
    sender.send("r2", [2], recv.address)
    assert wait_for(recv.poll, 20, "recv.poll")[0].status == TransferStatus.DONE
    assert all(torch.equal(d[:, 1], s[:, 2]) for s, d in zip(src, dst, strict=True))
    sender.close()


def test_layerwise_layers_land_while_later_layers_compute(receiver, backend, monkeypatch):
    """`begin` before a pass, `layer_computed` after each layer, `finish` with the metadata:
    layer i is in the receiver's blocks before layer i+1 exists, and the request is DONE only
    once the trailer (the first token) is there. Two requests of one pass share the channel."""
    monkeypatch.setattr(chunks, "CHUNK_MIN_BYTES", 1)  # one message per layer
    recv, dst = receiver
    before = [c.clone() for c in dst]
    src = [torch.zeros_like(c) for c in caches()]  # the pass fills a layer at a time
    final = caches(seed=5)
    sender = create_sender(backend, kv_caches=src, layout=layout(src), name="p0", timeout_s=10)
    plan = {"a": ([0, 5, 7], [9, 3, 12]), "b": ([2], [1])}
    for rid, (src_ids, dst_ids) in plan.items():
        recv.expect(rid, dst_ids, timeout_s=10)
        assert sender.begin(rid, src_ids, recv.address)
    for layer in range(len(src)):
        src[layer].copy_(final[layer])
        sender.layer_computed(layer)

        def landed(layer=layer):  # this layer is in the receiver's blocks (its poll writes it)
            if all(torch.equal(dst[layer][:, d], final[layer][:, s]) for s, d in plan.values()):
                return [True]
            return recv.poll()

        assert wait_for(landed, 20, f"layer {layer} landed") == [True]
        for later in range(layer + 1, len(src)):  # later layers are untouched
            assert torch.equal(dst[later], before[later])
    time.sleep(0.2)  # lets time pass on purpose: no result may come without the trailer
    assert recv.poll() == []  # every layer is in, but not the first token yet
    sender.finish("b", {"first_token": 7})
    sender.finish("a", {"first_token": 42})
    results = wait_for(recv.poll, 20, "recv.poll")
    results += [] if len(results) == 2 else wait_for(recv.poll, 20, "recv.poll")
    assert sorted((r.request_id, r.status, r.meta["first_token"]) for r in results) == [
        ("a", TransferStatus.DONE, 42),
        ("b", TransferStatus.DONE, 7),
    ]
    acked = wait_for(sender.poll, 20, "sender.poll")
    acked += [] if len(acked) == 2 else wait_for(sender.poll, 20, "sender.poll")
    assert sorted((r.request_id, r.status, r.num_chunks) for r in acked) == [
        ("a", TransferStatus.DONE, 3),  # a message per layer
        ("b", TransferStatus.DONE, 3),
    ]
    # The channel is still in step for a whole-request send.
    recv.expect("c", [0], timeout_s=10)
    sender.send("c", [4], recv.address, meta={"first_token": 1})
    [done] = wait_for(recv.poll, 20, "recv.poll")
    assert done.status == TransferStatus.DONE and done.meta == {"first_token": 1}
    assert all(torch.equal(d[:, 0], f[:, 4]) for f, d in zip(final, dst, strict=True))
    sender.close()


def test_layerwise_without_trailer_times_out_retryable(receiver, backend):
    recv, _ = receiver
    src = caches()
    sender = create_sender(backend, kv_caches=src, layout=layout(src), name="p0", timeout_s=10)
    recv.expect("r1", [2], timeout_s=1.0)
    sender.begin("r1", [0], recv.address)
    for layer in range(len(src)):
        sender.layer_computed(layer)
    [result] = wait_for(recv.poll, 20, "recv.poll")  # all KV landed, but the first token never came
    assert result.status == TransferStatus.FAILED and result.retryable
    sender.close()


def test_out_of_range_block_id_is_refused_before_anything_is_sent(receiver, backend):
    recv, _ = receiver
    src = caches()
    sender = create_sender(backend, kv_caches=src, layout=layout(src), name="p0", timeout_s=10)
    with pytest.raises(ValueError, match=r"block_ids: 16 is not in \[0, 16\)"):
        sender.send("r1", [0, 16], recv.address)
    recv.expect("r2", [1], timeout_s=10)  # the channel is still in step
    sender.send("r2", [2], recv.address)
    assert [r.status for r in wait_for(recv.poll, 20, "recv.poll")] == [TransferStatus.DONE]
    sender.close()


def test_two_tp_shards_reassemble_into_one_receiver(receiver, backend):
    recv, dst = receiver
    full = caches()
    senders = []
    for rank in range(2):
        shard = [c[:, :, :, 2 * rank : 2 * rank + 2].contiguous() for c in full]
        senders.append(
            create_sender(
                backend, kv_caches=shard, layout=layout(shard, 4, 2, rank), name=f"p{rank}"
            )
        )
    # Both ranks send their heads under one request id; it is done when both landed.
    recv.expect("r", [4, 6], timeout_s=10)
    for rank, s in enumerate(senders):
        s.send("r", [1, 2], recv.address, meta={"first_token": 42, "rank": rank})
    [done] = wait_for(recv.poll, 20, "recv.poll")
    assert done.status == TransferStatus.DONE and done.meta == {"first_token": 42, "rank": 0}
    for f, d in zip(full, dst, strict=True):
        assert torch.equal(d[:, [4, 6]], f[:, [1, 2]])
    for s in senders:
        assert [r.status for r in wait_for(s.poll, 20, "s.poll")] == [TransferStatus.DONE]
        s.close()


def test_handshake_mismatch_refused_on_both_sides(receiver, backend):
    recv, _ = receiver
    src = caches(dtype=torch.bfloat16)
    sender = create_sender(backend, kv_caches=src, layout=layout(src), name="bad", timeout_s=10)
    with pytest.raises(HandshakeError, match="dtype: sender 'bfloat16' != receiver 'float32'"):
        sender.send("r1", [0], recv.address)
    sender.close()


@pytest.mark.parametrize("old_side", ["sender", "receiver"])
def test_a_peer_of_another_layout_version_is_refused_naming_both(backend, old_side):
    """A worker of the release before pieces (layout version 4) and one of this release
    refuse each other at the handshake, whichever side is older, naming both versions;
    the newer side then serves a peer of its own version as before."""
    old = KV_LAYOUT_VERSION - 1
    dst, src = caches(seed=1), caches()
    recv_layout, send_layout = layout(dst), layout(src)
    if old_side == "receiver":
        recv_layout = dataclasses.replace(recv_layout, version=old)
    else:
        send_layout = dataclasses.replace(send_layout, version=old)
    recv = create_receiver(backend, kv_caches=dst, layout=recv_layout, timeout_s=10)
    sender = create_sender(backend, kv_caches=src, layout=send_layout, name="p0", timeout_s=10)
    versions = (old, KV_LAYOUT_VERSION) if old_side == "sender" else (KV_LAYOUT_VERSION, old)
    expected = f"KV layout version: sender {versions[0]} != receiver {versions[1]}; "
    with pytest.raises(HandshakeError, match=expected) as info:
        sender.send("r1", [0], recv.address)
    assert "different duet releases" in str(info.value)
    assert recv.poll() == [] and sender.poll() == []
    sender.close()
    if old_side == "sender":  # the receiver takes a sender of its own version next
        same = create_sender(backend, kv_caches=src, layout=layout(src), name="p1", timeout_s=10)
        recv.expect("r2", [3], timeout_s=10)
        same.send("r2", [2], recv.address)
        assert [r.status for r in wait_for(recv.poll, 20, "recv.poll")] == [TransferStatus.DONE]
        assert all(torch.equal(d[:, 3], s[:, 2]) for s, d in zip(src, dst, strict=True))
        same.close()
    recv.close()


def test_abort_drops_late_data(receiver, backend):
    recv, dst = receiver
    before = [c.clone() for c in dst]
    src = caches()
    sender = create_sender(backend, kv_caches=src, layout=layout(src), name="p0", timeout_s=10)
    recv.expect("r1", [3], timeout_s=10)
    recv.abort("r1")
    sender.send("r1", [0], recv.address)
    assert [r.status for r in recv.poll()] == [TransferStatus.ABORTED]
    time.sleep(0.5)  # lets time pass on purpose: the late data lands nowhere, reports nothing
    assert recv.poll() == []
    assert all(torch.equal(a, b) for a, b in zip(before, dst, strict=True))
    sender.close()


def test_expect_times_out_retryable(receiver, backend):
    recv, _ = receiver
    recv.expect("never", [1], timeout_s=0.2)
    [result] = wait_for(recv.poll, 20, "recv.poll")
    assert result.status == TransferStatus.FAILED and result.retryable


def test_unreachable_receiver_is_retryable(backend):
    src = caches()
    sender = create_sender(backend, kv_caches=src, layout=layout(src), name="p0", timeout_s=1)
    sender.send("r1", [0], "127.0.0.1:1")
    [result] = sender.poll()
    assert result.status == TransferStatus.FAILED and result.retryable
    sender.close()


SENDER_SCRIPT = """
import sys
import os, sys, time, torch
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
from duet.kv_transfer import KVLayout, create_sender
kv = [torch.zeros(2, 16, 4, 4, 8) for _ in range(3)]
s = create_sender(sys.argv[2], kv_caches=kv, layout=KVLayout.of_caches("m", kv, 4), name="doomed", timeout_s=10)
s.connect(sys.argv[1])
print("connected", flush=True)
time.sleep(60)
"""


def test_sender_killed_receiver_times_out_and_reports_retryable(receiver, backend):
    recv, _ = receiver
    proc = subprocess.Popen(
        [sys.executable, "-c", SENDER_SCRIPT, recv.address, backend],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "connected"
        recv.expect("r1", [2], timeout_s=1.5)
        proc.kill()
        proc.wait(10)
        [result] = wait_for(recv.poll, 20, "recv.poll")
        assert result.status == TransferStatus.FAILED and result.retryable
    finally:
        proc.kill()
