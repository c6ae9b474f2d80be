"""AdmissionController: sequences in flight never exceed running + queued capacity."""

from __future__ import annotations

import pytest

from router.admission import AdmissionController
from router.errors import OverloadedError


def test_admits_up_to_capacity_then_refuses_with_retry_after() -> None:
    ctl = AdmissionController(max_running=2, max_queued=1, retry_after_s=3)
    tickets = ctl.admit([1]) + ctl.admit([2])
    assert ctl.num_in_flight == 3
    assert ctl.num_queued == 1
    with pytest.raises(OverloadedError) as info:
        ctl.admit([1])
    assert info.value.status_code == 503
    assert info.value.headers == {"Retry-After": "3"}
    tickets[1].release()
    tickets[1].release()  # idempotent
    assert ctl.num_in_flight == 1
    assert [t.weight for t in ctl.admit([1, 1])] == [1, 1]  # all or none
    with pytest.raises(OverloadedError):
        ctl.admit([1])
    assert ctl.num_in_flight == 3


def test_idle_server_takes_one_request_heavier_than_capacity() -> None:
    ctl = AdmissionController(max_running=1, max_queued=0)
    [ticket] = ctl.admit([8])
    with pytest.raises(OverloadedError):
        ctl.admit([1])
    ticket.release()
    assert ctl.num_in_flight == 0


def test_rejects_bad_limits() -> None:
    with pytest.raises(ValueError, match="max_queued_requests"):
        AdmissionController(max_running=1, max_queued=-1)
