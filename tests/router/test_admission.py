"""AdmissionController: sequences in flight never exceed running + queued capacity."""

from __future__ import annotations

import pytest

from duet.router.admission import AdmissionController
from duet.router.errors import OverloadedError


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


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_default_queue_admits_a_burst_until_a_rate_is_measured() -> None:
    ctl = AdmissionController(max_running=4, clock=FakeClock())
    tickets = ctl.admit([1] * 600)  # guidellm's throughput profile: 512 at once, and more
    assert ctl.num_queued == 596
    assert ctl.drain_rate() is None
    assert len(tickets) == 600


def test_default_queue_refuses_only_what_could_not_start_within_the_wait() -> None:
    clock = FakeClock()
    ctl = AdmissionController(max_running=2, max_queue_wait_s=10.0, clock=clock)
    tickets = ctl.admit([1] * 12)  # 2 running, 10 queued: saturated from now on
    for t in tickets[:4]:  # 4 sequences leave over 2 s: 2 per second
        clock.now += 0.5
        t.release()
    assert ctl.drain_rate() == pytest.approx(2.0)
    # 8 in flight, 6 queued; room for 20 queued (10 s x 2/s): 14 more fit, the 15th does not.
    more = ctl.admit([1] * 14)
    assert ctl.estimated_wait_s(0) == pytest.approx(10.0)
    with pytest.raises(OverloadedError, match="estimated queue wait 10s exceeds 10s"):
        ctl.admit([1])
    more[0].release()
    clock.now += 0.5  # the rate is now 5 in 2.5 s: still 2/s, and one slot opened
    assert ctl.admit([1])


def test_departures_below_saturation_do_not_count_as_the_drain_rate() -> None:
    clock = FakeClock()
    ctl = AdmissionController(max_running=8, max_queue_wait_s=1.0, clock=clock)
    for _ in range(10):  # a trickle: one at a time, each 5 s
        [t] = ctl.admit([1])
        clock.now += 5
        t.release()
    assert ctl.drain_rate() is None
    assert len(ctl.admit([1] * 50)) == 50  # a burst is still queued


def test_fixed_queue_bound_still_applies() -> None:
    ctl = AdmissionController(max_running=1, max_queued=2, clock=FakeClock())
    ctl.admit([1, 1, 1])
    with pytest.raises(OverloadedError, match="room for 3"):
        ctl.admit([1])


def test_rejects_a_non_positive_wait() -> None:
    with pytest.raises(ValueError, match="max_queue_wait_s"):
        AdmissionController(max_running=1, max_queue_wait_s=0)
