"""The nixl backend beyond the shared channel suites (test_channels.py, test_draft_layers.py,
test_poll.py run it in pull and push mode): many requests at once, prefix blocks shared by
concurrent transfers, the descriptors a transfer makes, peers killed or stopped mid-transfer,
and membership (join, leave, a receiver that restarts)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from duet.kv_transfer import TransferStatus, create_receiver, create_sender
from duet.kv_transfer.nixl.regions import GroupRegions, Side, pair_descs
from duet.kv_transfer.nixl.windows import CLOCK_SKEW_S
from tests.kv_transfer.paged import caches, layout
from tests.waiting import wait_for

MODES = ["pull", "push"]

SENDER_SCRIPT = """
import sys, time, torch
from duet.kv_transfer import create_sender
from tests.kv_transfer.paged import caches, layout
kv = caches()
s = create_sender("nixl", kv, layout(kv), name="doomed", timeout_s=float(sys.argv[2]),
                  mode=sys.argv[3])
s.begin("r1", [0, 5, 7], sys.argv[1])  # layer-wise: layer 0 is computed, 1 and 2 never are
s.layer_computed(0)
while not s.loop.call(lambda: all(o.announced == 1 for o in s._offers.values()), 10):
    time.sleep(0.01)
print("offered", flush=True)
time.sleep(120)
"""

RECEIVER_SCRIPT = """
import sys, time
from duet.kv_transfer import create_receiver
from tests.kv_transfer.paged import caches, layout
kv = caches(seed=1)
r = create_receiver("nixl", kv, layout(kv), timeout_s=float(sys.argv[1]))
print(r.address, flush=True)
time.sleep(120)  # never expects anything: an offer stays unread
"""


@contextlib.contextmanager
def peer(script: str, *args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A peer process and the first line it printed; killed on the way out."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        yield proc, proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait(10)


def heard(receiver, request_id: str) -> bool:
    """The receiver holds a sender's offer of `request_id` with layer 0 computed (a message a
    sender killed right after sending it may never have delivered)."""
    with receiver._lock:
        pending = receiver._pending.get(request_id)
        return pending is not None and any(s.layers_ready >= 1 for s in pending.shards.values())


def collect(poll, count: int, timeout_s: float = 20) -> list:
    """`count` results from `poll`, in the order reported."""
    results: list = []

    def more():
        results.extend(poll())
        return len(results) >= count

    wait_for(more, timeout_s, f"{count} results")
    assert len(results) == count
    return results


@pytest.mark.parametrize("mode", MODES)
def test_many_requests_at_once_and_shared_prefix_blocks(mode):
    """Eight transfers in flight together, two of them (a prefix hit on the prefill side)
    reading the same source blocks: each lands bit-exact in its own blocks, each side reports
    each transfer exactly once."""
    src, dst = caches(num_blocks=64), caches(num_blocks=64, seed=1)
    recv = create_receiver("nixl", dst, layout(dst), timeout_s=10)
    sender = create_sender("nixl", src, layout(src), name="p0", timeout_s=10, mode=mode)
    plan = {  # request -> (source blocks, reserved blocks)
        f"r{i}": (
            list(range(3 * i, 3 * i + 1 + i % 3)),
            list(range(40 - 3 * i, 41 - 3 * i + i % 3)),
        )
        for i in range(6)
    }
    plan["prefix-a"] = ([50, 51, 52], [60, 61, 62])
    plan["prefix-b"] = ([50, 51, 53], [55, 56, 57])  # blocks 50 and 51: the shared prefix
    try:
        for rid, (_, dst_ids) in plan.items():
            recv.expect(rid, dst_ids, timeout_s=10)
        for rid, (src_ids, _) in plan.items():
            sender.send(rid, src_ids, recv.address, meta={"first_token": len(rid)})
        done = collect(recv.poll, len(plan))
        assert sorted((r.request_id, r.status, r.meta["first_token"]) for r in done) == sorted(
            (rid, TransferStatus.DONE, len(rid)) for rid in plan
        )
        acked = collect(sender.poll, len(plan))
        assert sorted((r.request_id, r.status) for r in acked) == sorted(
            (rid, TransferStatus.DONE) for rid in plan
        )
        for src_ids, dst_ids in plan.values():
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(d[:, dst_ids], s[:, src_ids])
    finally:
        sender.close()
        recv.close()


def test_descriptors_merge_runs_and_slice_heads_per_token():
    """Consecutive blocks on both sides make one descriptor per layer and K/V; a shard of 2 of
    4 heads makes one per token, at the receiver's head offset."""
    wide = GroupRegions(bases=[1 << 20, 2 << 20], num_planes=2, num_blocks=16, block_size=4,
                        heads=4, head_bytes=32)  # fmt: skip
    narrow = GroupRegions(bases=[3 << 20, 4 << 20], num_planes=2, num_blocks=8, block_size=4,
                          heads=2, head_bytes=32)  # fmt: skip
    row = 4 * 4 * 32  # a wide row: 4 tokens of 4 heads
    local, remote = pair_descs(
        Side(wide, np.array([3, 4, 5])), Side(wide, np.array([10, 11, 12])), range(2)
    )
    # per layer: the K rows of blocks 3-5 in one run, the V rows in another
    assert local.tolist() == [
        [(1 << 20) + 3 * row, 3 * row, 0],
        [(1 << 20) + (16 + 3) * row, 3 * row, 0],
        [(2 << 20) + 3 * row, 3 * row, 0],
        [(2 << 20) + (16 + 3) * row, 3 * row, 0],
    ]
    assert remote[:, 0].tolist() == [
        (1 << 20) + 10 * row, (1 << 20) + 26 * row, (2 << 20) + 10 * row, (2 << 20) + 26 * row
    ]  # fmt: skip
    # Block 7 does not continue block 3: two runs per K/V.
    local, _ = pair_descs(Side(wide, np.array([3, 7])), Side(wide, np.array([1, 2])), range(1))
    assert local[:, 1].tolist() == [row, row, row, row]
    # A head shard: the receiver's wide rows take heads [2, 4) of each token, 64 bytes apiece.
    local, remote = pair_descs(
        Side(wide, np.array([9]), head_offset=2), Side(narrow, np.array([1])), range(1),
        num_heads=2,
    )  # fmt: skip
    tokens = np.arange(4)
    assert local[:4, 0].tolist() == ((1 << 20) + 9 * row + tokens * 128 + 2 * 32).tolist()
    assert remote[:4, 0].tolist() == ((3 << 20) + 1 * 256 + tokens * 64).tolist()
    assert set(local[:, 1].tolist()) == {64} and local.shape == (8, 3)  # K and V: 4 tokens each
    # Both sides sliced (layouts that split heads differently): head 1 of 2 into head 3 of 4.
    local, remote = pair_descs(
        Side(wide, np.array([9]), head_offset=3), Side(narrow, np.array([1]), head_offset=1),
        range(1), num_heads=1,
    )  # fmt: skip
    assert local[:4, 0].tolist() == ((1 << 20) + 9 * row + tokens * 128 + 3 * 32).tolist()
    assert remote[:4, 0].tolist() == ((3 << 20) + 1 * 256 + tokens * 64 + 32).tolist()
    assert set(local[:, 1].tolist()) == {32}
    with pytest.raises(ValueError, match=r"heads \[2, \+2\) of 2"):
        pair_descs(Side(wide, np.array([9])), Side(narrow, np.array([1]), 2), range(1), num_heads=2)


@pytest.mark.parametrize("mode", MODES)
def test_a_sender_killed_mid_transfer_fails_only_its_request(mode):
    """The sender offered layer 0 of 3, then died: the receiver fails that request (retryable)
    within the transfer timeout, long before its own wait ends, while another sender's request
    completes; the blocks of the failed one are reported once, for the caller to free."""
    dst = caches(seed=1)
    recv = create_receiver("nixl", dst, layout(dst), timeout_s=2)
    other = create_sender("nixl", caches(), layout(caches()), name="other", timeout_s=2)
    try:
        recv.expect("r1", [9, 3, 12], timeout_s=60)
        with peer(SENDER_SCRIPT, recv.address, "2", mode) as (proc, line):
            assert line == "offered"
            wait_for(lambda: heard(recv, "r1"), 10, "the offer of layer 0 received")
            start = time.monotonic()
            proc.kill()
            proc.wait(10)
            recv.expect("r2", [1], timeout_s=60)
            other.send("r2", [2], recv.address)
            results = {r.request_id: r for r in collect(recv.poll, 2)}
        took = time.monotonic() - start
        assert results["r2"].status == TransferStatus.DONE
        assert (results["r1"].status, results["r1"].retryable) == (TransferStatus.FAILED, True)
        assert took < 2 + CLOCK_SKEW_S + 1  # the sender's window (timeout / 2), not the wait
        assert recv.poll() == []  # reported once
    finally:
        other.close()
        recv.close()


def test_a_stopped_sender_fails_its_request_within_the_timeout():
    """A sender that stops answering (SIGSTOP) mid-transfer: the read of its layer 0 gets no
    progress (UCX needs the peer's answer) and is cancelled after its run time, or, read
    already, the sender's window passes with layers still to come: FAILED, retryable, within
    the timeout."""
    dst = caches(seed=1)
    recv = create_receiver("nixl", dst, layout(dst), timeout_s=2)
    try:
        recv.expect("r1", [9, 3, 12], timeout_s=60)
        with peer(SENDER_SCRIPT, recv.address, "2", "pull") as (proc, line):
            assert line == "offered"
            wait_for(lambda: heard(recv, "r1"), 10, "the offer of layer 0 received")
            os.kill(proc.pid, signal.SIGSTOP)
            start = time.monotonic()
            [result] = collect(recv.poll, 1)
            took = time.monotonic() - start
        assert (result.status, result.retryable) == (TransferStatus.FAILED, True)
        assert "timed out" in result.error or "silent" in result.error
        assert took < 2 + CLOCK_SKEW_S
    finally:
        recv.close()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_lost_receiver_fails_the_transfer_within_the_timeout(how):
    """The receiver holds an offer it never reads, then dies or stops: the sender's pings
    fail the transfer (retryable) within about the timeout, not at its lease, and only once
    the receiver's window on the blocks has closed (the caller frees them then)."""
    src = caches()
    sender = create_sender("nixl", src, layout(src), name="p0", timeout_s=2, ack_timeout_s=60)
    try:
        with peer(RECEIVER_SCRIPT, "30") as (proc, address):
            sender.send("r1", [0, 5, 7], address, meta={"first_token": 1})
            wait_for(lambda: sender._offers["r1"].announced == 3, 10, "the offer sent")
            start = time.monotonic()
            if how == "killed":
                proc.kill()
            else:
                os.kill(proc.pid, signal.SIGSTOP)
            [result] = collect(sender.poll, 1, timeout_s=30)
            took = time.monotonic() - start
        assert (result.status, result.retryable) == (TransferStatus.FAILED, True)
        # held for the receiver's window (1 s to start, 1 s to run, the clock skew), then out
        assert 2 + CLOCK_SKEW_S - 0.5 <= took < 2 + 2 + CLOCK_SKEW_S + 1
    finally:
        sender.close()


def test_join_leave_and_a_receiver_that_restarts():
    """Senders join on their first transfer and leave on close (the receiver drops their
    agent); a sender whose receiver restarted (a new agent that does not know it) joins the
    new one on its next transfer; nothing restarts."""
    src, dst = caches(), caches(seed=1)
    recv = create_receiver("nixl", dst, layout(dst), timeout_s=5)
    first = create_sender("nixl", src, layout(src), name="p0", timeout_s=5)
    second = create_sender("nixl", src, layout(src), name="p1", timeout_s=5)
    try:
        assert recv.peers == []
        for rid, sender in (("a", first), ("b", second)):
            recv.expect(rid, [1], timeout_s=10)
            sender.send(rid, [2], recv.address)
        assert [r.status for r in collect(recv.poll, 2)] == [TransferStatus.DONE] * 2
        assert recv.peers == sorted([first.loop.agent_name, second.loop.agent_name])
        first.close()
        assert recv.peers == [second.loop.agent_name]
        # A receiver restarts at another address (a new agent); the sender joins it anew.
        recv.close()
        recv = create_receiver("nixl", dst, layout(dst), timeout_s=5)
        recv.expect("c", [4], timeout_s=10)
        second.send("c", [6], recv.address)
        assert [r.status for r in collect(recv.poll, 1)] == [TransferStatus.DONE]
        assert recv.peers == [second.loop.agent_name]
        assert torch.equal(dst[0][:, 4], src[0][:, 6])
    finally:
        second.close()
        recv.close()


@pytest.mark.parametrize("operator", [None, "y"])
def test_ucx_memtype_cache_is_off_unless_the_operator_set_it(monkeypatch, operator):
    """On an H200 UCX's memory-type cache took a KV cache allocated before its first context
    for host memory and NIXL refused it (NIXL_ERR_BACKEND): load_nixl turns the cache off
    before any agent exists, and leaves an operator's own setting alone."""
    from duet.kv_transfer.nixl.agent import load_nixl

    if operator is None:
        monkeypatch.delenv("UCX_MEMTYPE_CACHE", raising=False)
    else:
        monkeypatch.setenv("UCX_MEMTYPE_CACHE", operator)
    load_nixl()
    assert os.environ["UCX_MEMTYPE_CACHE"] == (operator or "n")


@pytest.mark.parametrize(("cuda", "operator", "want"), [
    (True, None, "on"), (True, "off", "off"), (False, None, None),
])  # fmt: skip
def test_cuda_ipc_reads_are_zero_copy_on_cuda_unless_the_operator_said(
    monkeypatch, cuda, operator, want
):
    """UCX reads CUDA memory over CUDA IPC only where it finds NVLink, else emulates the read
    over TCP (a pull at 0.07 GB/s on an H200): with CUDA, load_nixl turns the zero-copy read on
    before any agent exists, leaves an operator's setting alone, and without CUDA sets nothing
    (UCX would warn that the variable is unused)."""
    from duet.kv_transfer.nixl.agent import GET_ZCOPY_ENV, load_nixl

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setenv(GET_ZCOPY_ENV, operator or "")  # undone after the test, whatever it set
    if operator is None:
        monkeypatch.delenv(GET_ZCOPY_ENV)
    load_nixl()
    assert os.environ.get(GET_ZCOPY_ENV) == want
