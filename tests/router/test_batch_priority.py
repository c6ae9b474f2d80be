"""Batch work yields to interactive traffic: the slot policy, and waiting out a refused
admission instead of burning a delivery."""

from __future__ import annotations

import asyncio

import pytest

from duet.router.admission import AdmissionController
from duet.router.batch_runner import BatchPriority, wait_out_overload
from duet.router.errors import OverloadedError


@pytest.mark.parametrize(
    ("num_interactive", "num_batch", "free"),
    [
        (0, 0, 4),  # idle: at most half of 8 slots run batch lines
        (0, 3, 1),
        (0, 4, 0),
        (3, 0, 1),  # interactive requests running: an eighth (at least one)
        (1, 1, 0),
        (1, 3, 0),  # lines started while idle run on; no new one until under the share
        (5, 0, 1),  # 8 - 2 reserved - 5 interactive
        (6, 0, 0),  # interactive traffic fills all but the reserve: no new line
        (5, 1, 0),
    ],
)
def test_batch_lines_take_only_idle_slots(num_interactive: int, num_batch: int, free: int) -> None:
    admission = AdmissionController(8)
    if num_interactive + num_batch:
        admission.admit([1] * (num_interactive + num_batch))
    assert BatchPriority().free_slots(admission, num_batch) == free


def test_bad_priorities_are_named() -> None:
    with pytest.raises(ValueError, match="max_fraction"):
        BatchPriority(max_fraction=0)
    with pytest.raises(ValueError, match="reserved_fraction"):
        BatchPriority(reserved_fraction=1)
    with pytest.raises(ValueError, match="shared_fraction"):
        BatchPriority(shared_fraction=0)


def test_an_overloaded_admission_is_waited_out_then_given_up() -> None:
    calls: list[int] = []

    async def attempt() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise OverloadedError("busy")
        return "ran"

    assert asyncio.run(wait_out_overload(attempt, max_wait_s=10)) == "ran"
    assert len(calls) == 3

    async def always_busy() -> str:
        raise OverloadedError("busy")

    with pytest.raises(OverloadedError):
        asyncio.run(wait_out_overload(always_busy, max_wait_s=0))
