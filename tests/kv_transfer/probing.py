"""What the link-probe tests of both backends share (test_link_probe.py for tcp,
test_torch_dist_probe.py for torch_dist): a sender that probes, one transfer end to end (whole
or layer-wise), and a gate that holds up a receiver's handling of probes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from duet.kv_transfer import TransferStatus, create_sender
from tests.kv_transfer.paged import layout
from tests.waiting import wait_for


def probing_sender(backend, kv, measure_link=True, timeout_s=10.0):  # type: ignore[no-untyped-def]
    """Sender "p0" over `kv`; with `measure_link`, it probes each receiver's link."""
    return create_sender(backend, kv_caches=kv, layout=layout(kv), name="p0",
                         timeout_s=timeout_s, measure_link=measure_link)  # fmt: skip


def transfer(sender, recv, request_id, src_ids, dst_ids, expect_timeout_s=10.0):  # type: ignore[no-untyped-def]
    """One transfer that both sides report DONE; returns the sender's result."""
    recv.expect(request_id, dst_ids, timeout_s=expect_timeout_s)
    sender.send(request_id, src_ids, recv.address)
    got = wait_for(recv.poll, 20, "recv.poll")
    assert [r.status for r in got] == [TransferStatus.DONE], (got, sender.poll())
    [result] = wait_for(sender.poll, 20, "sender.poll")
    return result


def layerwise_transfer(  # type: ignore[no-untyped-def]
    sender, recv, request_id, src_ids, dst_ids, num_layers, expect_timeout_s=10.0
):
    """As `transfer`, layer-wise: `begin`, each of the `num_layers` layers computed, `finish`."""
    recv.expect(request_id, dst_ids, timeout_s=expect_timeout_s)
    assert sender.begin(request_id, src_ids, recv.address)
    for layer in range(num_layers):
        sender.layer_computed(layer)
    sender.finish(request_id, {"first_token": 1})
    assert [r.status for r in wait_for(recv.poll, 20, "recv.poll")] == [TransferStatus.DONE]
    [result] = wait_for(sender.poll, 20, "sender.poll")
    return result


@contextmanager
def held_calls(
    monkeypatch: pytest.MonkeyPatch, cls: type, name: str, record: Callable[..., Any], wait_s: float
) -> Iterator[tuple[list[Any], threading.Event, threading.Event]]:
    """Patches `cls.name` so each call appends `record(*args)` to a list, sets an event at the
    first, and waits at a gate (up to `wait_s`) while it is clear. Yields (calls, that event,
    the gate), the gate open; it opens again on exit, so no held thread outlives the test."""
    calls: list[Any] = []
    entered, gate = threading.Event(), threading.Event()
    gate.set()
    real = getattr(cls, name)

    def held(self, *args):  # type: ignore[no-untyped-def]
        calls.append(record(*args))
        entered.set()
        gate.wait(wait_s)
        return real(self, *args)

    monkeypatch.setattr(cls, name, held)
    try:
        yield calls, entered, gate
    finally:
        gate.set()
