"""`WorkLanding`: when a channel's gloo operations complete, learned without blocking.

A gloo send or receive completes only inside `Work.wait()` (`is_completed()` stays False until
then, and a `wait` that times out closes the pair), so a thread per link waits its works in
issue order and counts them; a `LandingEvent` covers every operation posted before it and is
queried from any thread without blocking, as a CUDA event recorded after NCCL operations is.
A `WallMark` notes the wall time at which the works posted before it landed (the link probe
times its bursts with them, as CUDA events time them on a GPU).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class LinkError(RuntimeError):
    """An operation of a channel's link failed (plain gloo: the peer is gone)."""


class WorkLanding:
    """Waits posted works in issue order on a thread of its own. `on_landed` (given with a work)
    runs on that thread once the work completed, under the lock `close` takes: after `close`
    returns, no `on_landed` runs. With `raise_errors`, a failed work makes every event that
    covers it raise `LinkError`; without (NCCL's semantics), it and every later work simply never
    land. `hold` keeps completed works from landing until `release` (tests: data that has come
    in but whose event has not completed yet)."""

    def __init__(self, name: str, raise_errors: bool) -> None:
        self._raise_errors = raise_errors
        self._cond = threading.Condition()
        self._queue: deque[tuple[Any, Callable[[], Any] | None]] = deque()
        self._num_posted = 0
        self._num_landed = 0
        self._error: str | None = None
        self._closed = False
        self._held = False
        self._thread = threading.Thread(target=self._loop, name=f"kv-landing-{name}", daemon=True)
        self._thread.start()

    def post(self, work: Any, on_landed: Callable[[], Any] | None = None) -> None:
        """Track `work` (None: an operation that failed to post; it never lands)."""
        with self._cond:
            self._queue.append((work, on_landed))
            self._num_posted += 1
            self._cond.notify_all()

    def event(self) -> LandingEvent:
        """An event that completes once every work posted so far has landed."""
        with self._cond:
            return LandingEvent(self, self._num_posted)

    def mark(self) -> WallMark:
        """A mark stamped when every work posted so far has landed (by this thread)."""
        mark = WallMark()
        self.post(_NO_WORK, mark.stamp)
        return mark

    def hold(self) -> None:
        with self._cond:
            self._held = True

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def close(self) -> None:
        """Nothing lands from now on (a work being waited for is left to its gloo timeout)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def landed(self, seq: int) -> bool:
        """The first `seq` works landed; raises LinkError when one of them failed (and errors
        are raised)."""
        with self._cond:
            return self._landed(seq)

    def wait(self, seq: int, timeout_s: float) -> bool:
        """`landed(seq)`, waiting up to `timeout_s` for it (or for `close`)."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._closed or self._error is not None or self._done(seq), timeout_s
            )
            return self._landed(seq)

    def _done(self, seq: int) -> bool:
        return self._num_landed >= seq

    def _landed(self, seq: int) -> bool:
        if self._done(seq):
            return True
        if self._error is not None:
            raise LinkError(self._error)
        return False

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or bool(self._queue))
                if self._closed:
                    return
                work, on_landed = self._queue[0]
            try:
                if work is None:
                    raise LinkError("the operation could not be posted")
                work.wait()
            except Exception as e:  # the pair is lost: nothing after this work lands either
                with self._cond:
                    if self._raise_errors:
                        self._error = str(e)
                    self._cond.notify_all()
                return
            with self._cond:
                self._cond.wait_for(lambda: self._closed or not self._held)
                if self._closed:
                    return
                if on_landed is not None:
                    on_landed()
                self._queue.popleft()
                self._num_landed += 1
                self._cond.notify_all()


class LandingEvent:
    """Completes once the works posted before it landed (`WorkLanding.event`)."""

    def __init__(self, landing: WorkLanding, seq: int) -> None:
        self._landing = landing
        self._seq = seq

    def query(self) -> bool:
        """Never blocks; raises LinkError when a covered work failed (plain gloo)."""
        return self._landing.landed(self._seq)

    def wait(self, timeout_s: float) -> bool:
        return self._landing.wait(self._seq, timeout_s)


class WallMark:
    """When the works posted before it landed (`WorkLanding.mark`); `seconds_since` once an
    event recorded after both marks completed."""

    def __init__(self) -> None:
        self.at_s: float | None = None

    def stamp(self) -> None:
        self.at_s = time.monotonic()

    def seconds_since(self, earlier: object) -> float:
        assert isinstance(earlier, WallMark)
        assert self.at_s is not None and earlier.at_s is not None, "a mark has not landed"
        return self.at_s - earlier.at_s


class _NoWork:
    """What a mark waits for: nothing (it lands once the works before it did)."""

    def wait(self) -> None:
        pass


_NO_WORK = _NoWork()
