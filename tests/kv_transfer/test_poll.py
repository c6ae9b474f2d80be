"""`poll` never blocks, on either side, for every backend: with a peer that never answers (a
receiver that never acknowledges, then stopped outright; a sender stopped after connecting),
every call returns within `POLL_BOUND_S` while the transfer is pending, and the transfer still
ends FAILED (retryable) once its bound passes: the sender's lease, the receiver's `expect`
deadline."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from duet.kv_transfer import TransferResult, TransferStatus, create_receiver, create_sender
from duet.kv_transfer.local import LocalHub
from duet.kv_transfer.tcp import stripes
from tests.kv_transfer.paged import caches, layout

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

BACKENDS = ["local", "tcp", "tcp-striped", "torch_dist", "torch_dist-nccl-emulated", "nixl",
            "nixl-push"]  # fmt: skip
# NOTE: a poll that waited on the silent peer would take TIMEOUT_S; the bound sits well below
# that and well above a 2-core machine's scheduling delays under load (87 ms seen at a bound
# of 0.05 s; a `local` poll of 0.8 s at 0.25 s, when a blocking poll took 3 s: now 6).
POLL_BOUND_S = 1.5
LEASE_S = 1.0  # the sender's ack_timeout_s, and the receiver's expect timeout
TIMEOUT_S = 6.0  # each backend's wait on a silent peer: what a blocking poll would take

RECEIVER_SCRIPT = """
import os, sys, time
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
from duet.kv_transfer import create_receiver
from tests.kv_transfer.paged import caches, layout
kv = caches(seed=1)
r = create_receiver(sys.argv[1], kv, layout(kv), timeout_s=30)
print(r.address, flush=True)
time.sleep(120)  # never polls, so never acknowledges
"""

SENDER_SCRIPT = """
import os, sys, time
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
from duet.kv_transfer import create_sender
from tests.kv_transfer.paged import caches, layout
kv = caches()
s = create_sender(sys.argv[2], kv, layout(kv), name="silent", timeout_s=30)
s.connect(sys.argv[1])
print("connected", flush=True)
time.sleep(120)
"""


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    if request.param == "tcp-striped":  # every payload split over the channel's 2 connections
        monkeypatch.setattr(stripes, "STRIPE_MIN_BYTES", 1)
        return "tcp"
    if request.param == "torch_dist-nccl-emulated":  # peer processes inherit the environment
        monkeypatch.setenv("DUET_KV_EMULATE_NCCL", "1")
        return "torch_dist"
    if request.param == "nixl-push":
        monkeypatch.setenv("DUET_KV_NIXL_MODE", "push")
        return "nixl"
    return request.param


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


def poll_until_outcome(poll, limit_s: float) -> tuple[list[TransferResult], float, float]:
    """Poll every 5 ms until something is reported: (results, slowest call, seconds taken).
    Every call must return within POLL_BOUND_S."""
    start = time.monotonic()
    slowest = 0.0
    while time.monotonic() - start < limit_s:
        began = time.perf_counter()
        results = poll()
        took = time.perf_counter() - began
        slowest = max(slowest, took)
        assert took < POLL_BOUND_S, f"poll took {took * 1e3:.1f} ms"
        if results:
            return results, slowest, time.monotonic() - start
        time.sleep(0.005)
    raise AssertionError(f"nothing reported within {limit_s}s")


def test_sender_poll_never_blocks_on_a_silent_receiver(backend):
    src = caches()
    settings = {"name": "p0", "timeout_s": TIMEOUT_S, "ack_timeout_s": LEASE_S}
    with contextlib.ExitStack() as stack:
        if backend == "local":  # a receiver in the hub that is never polled: never acknowledges
            hub = LocalHub()
            dst = caches(seed=1)
            recv = create_receiver(backend, dst, layout(dst), hub=hub, name="d")
            stack.callback(recv.close)
            address = recv.address
            sender = create_sender(backend, src, layout(src), hub=hub, **settings)
            stack.callback(sender.close)
        else:
            proc, address = stack.enter_context(peer(RECEIVER_SCRIPT, backend))
            sender = create_sender(backend, src, layout(src), **settings)
            stack.callback(sender.close)
            sender.connect(address)  # the handshake, then the receiver stops answering at all
            os.kill(proc.pid, signal.SIGSTOP)
            stack.callback(proc.kill)  # before close(): its threads blocked on the peer return
        sender.send("r1", [0, 5, 7], address, meta={"first_token": 1})
        results, slowest, took = poll_until_outcome(sender.poll, 4 * TIMEOUT_S)
        print(f"{backend} sender: slowest poll {slowest * 1e3:.2f} ms, FAILED after {took:.2f}s")
    [result] = results
    assert (result.request_id, result.status, result.retryable) == (
        "r1",
        TransferStatus.FAILED,
        True,
    )
    assert LEASE_S * 0.9 <= took


def test_receiver_poll_never_blocks_on_a_silent_sender(backend):
    dst = caches(seed=1)
    with contextlib.ExitStack() as stack:
        if backend == "local":  # no sender ever delivers
            recv = create_receiver(backend, dst, layout(dst), hub=LocalHub(), timeout_s=TIMEOUT_S)
            stack.callback(recv.close)
        else:
            recv = create_receiver(backend, dst, layout(dst), timeout_s=TIMEOUT_S)
            stack.callback(recv.close)
            proc, line = stack.enter_context(peer(SENDER_SCRIPT, recv.address, backend))
            assert line == "connected"
            os.kill(proc.pid, signal.SIGSTOP)
        recv.expect("r1", [2, 4], timeout_s=LEASE_S)
        results, slowest, took = poll_until_outcome(recv.poll, 4 * TIMEOUT_S)
        print(f"{backend} receiver: slowest poll {slowest * 1e3:.2f} ms, FAILED after {took:.2f}s")
    [result] = results
    assert (result.request_id, result.status, result.retryable) == (
        "r1",
        TransferStatus.FAILED,
        True,
    )
    assert LEASE_S * 0.9 <= took


@pytest.mark.parametrize("emulate_nccl", ["0", "1"], ids=["gloo", "nccl-emulated"])
def test_a_stopped_torch_dist_receiver_holds_up_only_its_own_acknowledgements(
    emulate_nccl, monkeypatch
):
    """The sender reads acknowledgements on a thread per channel: one stalled on a stopped
    receiver's store leaves the other channel's transfer to be acknowledged at once."""
    monkeypatch.setenv("DUET_KV_EMULATE_NCCL", emulate_nccl)  # the peer process's too
    src, dst = caches(), caches(seed=1)
    live = create_receiver("torch_dist", dst, layout(dst), timeout_s=TIMEOUT_S)
    with contextlib.ExitStack() as stack:
        stack.callback(live.close)
        proc, stopped = stack.enter_context(peer(RECEIVER_SCRIPT, "torch_dist"))
        sender = create_sender(
            "torch_dist", src, layout(src), name="p0", timeout_s=TIMEOUT_S, ack_timeout_s=5.0
        )
        stack.callback(sender.close)
        # Its KV goes out (never acknowledged: that receiver never polls), then it stops: the
        # channel's ack thread blocks on its store. (A send to a stopped receiver is
        # test_torch_dist.py's test_a_receiver_that_stops_reading_fails_only_its_sends.)
        sender.send("to-stopped", [1], stopped)
        time.sleep(0.5)  # lets the KV go out on purpose: nothing observable marks it
        os.kill(proc.pid, signal.SIGSTOP)
        stack.callback(proc.kill)
        time.sleep(0.1)  # lets the ack thread block on the stopped store first
        live.expect("to-live", [3], timeout_s=TIMEOUT_S)
        sender.send("to-live", [2], live.address)
        [received] = poll_until_outcome(live.poll, 2 * TIMEOUT_S)[0]
        assert received.status == TransferStatus.DONE
        [acked], _, took = poll_until_outcome(sender.poll, 2 * TIMEOUT_S)
        assert (acked.request_id, acked.status) == ("to-live", TransferStatus.DONE)
        assert took < 1.0  # well before the stopped one's lease (5 s) ends it
