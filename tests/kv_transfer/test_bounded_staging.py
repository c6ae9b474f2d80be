"""The bounded staging pool under load: transfers totalling 12x a worker's pool go through it
at once, piece by piece, and its high-water mark is the pool's size, never more; a staging
allocation that fails fails one transfer (retryable) and the next goes through."""

from __future__ import annotations

import os

import pytest
import torch

from duet.kv_transfer import TransferStatus, create_receiver, create_sender
from tests.kv_transfer.paged import layout
from tests.waiting import wait_for

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

MIB = 1 << 20
POOL_BYTES = MIB  # the smallest pool: pieces of 256 KiB
NUM_SRC_BLOCKS = 1024  # a layer of 1024 blocks of [4, 4, 8] fp32, K and V: 1 MiB


@pytest.fixture(params=["torch_dist", "torch_dist-nccl-emulated", "tcp"])
def backend(request, monkeypatch):
    if request.param == "torch_dist-nccl-emulated":
        monkeypatch.setenv("DUET_KV_EMULATE_NCCL", "1")
        return "torch_dist"
    return request.param


def big_caches(num_blocks, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, 4, 4, 8, generator=g) for _ in range(3)]


def collect(poll, n, what):
    """`n` results from `poll`, by request id."""
    results = {}
    while len(results) < n:
        for result in wait_for(poll, 30, what):
            results[result.request_id] = result
    return results


def test_transfers_of_12x_the_pool_at_once_never_take_more_than_the_pool(backend):
    """Two senders, two transfers each, sent before the receiver expects any: the receiver
    stages pieces until its pool is full (every 256 KiB slot taken) and waits; once the
    requests are expected, the pieces stream through and every transfer lands bit-exact."""
    dst = big_caches(4 * NUM_SRC_BLOCKS, seed=1)
    recv = create_receiver(
        backend, kv_caches=dst, layout=layout(dst), timeout_s=10, staging_bytes=POOL_BYTES
    )
    sources = [big_caches(NUM_SRC_BLOCKS, seed=s) for s in (2, 3)]
    senders = [
        create_sender(backend, src, layout(src), name=f"p{i}", timeout_s=10,
                      staging_bytes=POOL_BYTES)
        for i, src in enumerate(sources)
    ]  # fmt: skip
    # Each transfer: all 1024 blocks of the sender (2 orders), into 1024 of the receiver's.
    plan = {}
    g = torch.Generator().manual_seed(0)
    dst_ids = torch.randperm(4 * NUM_SRC_BLOCKS, generator=g).view(4, -1).tolist()
    for t in range(4):
        src_ids = list(range(NUM_SRC_BLOCKS))
        plan[f"r{t}"] = (t // 2, src_ids if t % 2 == 0 else src_ids[::-1], dst_ids[t])
    total = sum(3 * 2 * len(ids) * 4 * 4 * 8 * 4 for _, ids, _ in plan.values())
    assert total == 12 * POOL_BYTES
    try:
        for rid, (s, src_ids, _) in plan.items():
            senders[s].send(rid, src_ids, recv.address, meta={"first_token": int(rid[1:])})
        pool = recv._staging
        wait_for(lambda: pool.num_waits > 0, 30, "the receiver waiting for room in its pool")
        assert pool.used_bytes == POOL_BYTES  # four pieces of 256 KiB, all nobody expects yet
        for rid, (_, _, ids) in plan.items():
            recv.expect(rid, ids, timeout_s=30)
        done = collect(recv.poll, 4, "the receiver's results")
        assert {r: (x.status, x.meta) for r, x in done.items()} == {
            f"r{t}": (TransferStatus.DONE, {"first_token": t}) for t in range(4)
        }
        for rid, (s, src_ids, ids) in plan.items():
            for src, d in zip(sources[s], dst, strict=True):
                assert torch.equal(d[:, ids], src[:, src_ids]), rid
        for s, sender in enumerate(senders):
            acked = collect(sender.poll, 2, "the sender's results")
            # 3 layers of 1 MiB, each in 4 pieces of 256 blocks
            assert sorted((r, x.status, x.num_chunks) for r, x in acked.items()) == [
                (f"r{2 * s + i}", TransferStatus.DONE, 12) for i in range(2)
            ]
        pools = [recv._staging] + ([s._staging for s in senders] if backend != "tcp" else [])
        for pool in pools:
            wait_for(lambda pool=pool: pool.used_bytes == 0, 10, "every slot back")
            assert pool.high_water_bytes <= POOL_BYTES
        assert recv._staging.high_water_bytes == POOL_BYTES
    finally:
        for sender in senders:
            sender.close()
        recv.close()


def fail_first_allocation(pool, monkeypatch):
    allocate = pool._allocate
    calls = []

    def allocate_or_fail():
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return allocate()

    monkeypatch.setattr(pool, "_allocate", allocate_or_fail)
    return calls


@pytest.mark.parametrize(
    ("backend", "side"),
    [("torch_dist", "sender"), ("torch_dist", "receiver"), ("torch_dist-nccl-emulated", "sender"),
     ("torch_dist-nccl-emulated", "receiver"), ("tcp", "receiver")],  # tcp's sender never stages
    indirect=["backend"],
)  # fmt: skip
def test_a_failed_staging_allocation_fails_one_transfer_and_the_next_goes_through(
    backend, side, monkeypatch
):
    dst = big_caches(64, seed=1)
    recv = create_receiver(backend, kv_caches=dst, layout=layout(dst), timeout_s=2)
    src = big_caches(64, seed=2)
    # torch_dist: a sender whose pieces all left learns of a receiver that lost them at its
    # lease (tcp: when the receiver closes the channel)
    sender = create_sender(backend, src, layout(src), name="p0", timeout_s=2, ack_timeout_s=3)
    calls = fail_first_allocation((sender if side == "sender" else recv)._staging, monkeypatch)
    try:
        if backend == "tcp":  # sent before expected: the receiver stages it
            sender.send("r1", [0, 1, 2], recv.address)
            wait_for(lambda: calls, 10, "the staging allocation")
            recv.expect("r1", [7, 8, 9], timeout_s=10)
        else:
            recv.expect("r1", [7, 8, 9], timeout_s=10)
            sender.send("r1", [0, 1, 2], recv.address)
        [failed] = wait_for(sender.poll, 20, "the sender's result")
        assert (failed.request_id, failed.status, failed.retryable) == (
            "r1", TransferStatus.FAILED, True,
        )  # fmt: skip
        if side == "sender":
            assert "could not allocate the 268435456-byte KV staging pool" in failed.error
            recv.abort("r1")  # nothing was sent: the router gives the reservation up
            assert [r.status for r in recv.poll()] == [TransferStatus.ABORTED]
        else:
            [lost] = wait_for(recv.poll, 20, "the receiver's result")
            assert (lost.status, lost.retryable) == (TransferStatus.FAILED, True)
            assert "could not allocate the 268435456-byte KV staging pool" in lost.error
        assert all(torch.count_nonzero(d[:, [7, 8, 9]]) > 0 for d in dst)  # random init
        if backend == "tcp":  # staged again: the pool is allocated now
            sender.send("r2", [5, 6, 4], recv.address)
            wait_for(lambda: len(calls) == 2, 10, "the second staging allocation")
            recv.expect("r2", [7, 8, 9], timeout_s=10)
        else:
            recv.expect("r2", [7, 8, 9], timeout_s=10)
            sender.send("r2", [5, 6, 4], recv.address)
        assert [r.status for r in wait_for(recv.poll, 20, "recv.poll")] == [TransferStatus.DONE]
        assert [r.status for r in wait_for(sender.poll, 20, "sender.poll")] == [TransferStatus.DONE]
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[:, [7, 8, 9]], s[:, [5, 6, 4]])
        assert len(calls) == 2  # allocated on the second try, then kept
    finally:
        sender.close()
        recv.close()
