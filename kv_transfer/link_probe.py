"""`LinkProber`: a sender measures its link to each receiver, off the transfer path.

A transfer's achieved GB/s means little alone; docs/observability.md puts it beside the rate of
the link it went over. That rate is measured: a probe (the backend's `Probe`: a timed burst of a
few MiB over a channel like the transfers', which the receiver reads and drops), not a
configured number, and not the transfers' own best (only what some transfer achieved).

When: the first transfer to a receiver starts it (`start`), on a thread of its own, so no
transfer waits for it. A probe sharing the link with a transfer would measure neither, so each
try waits for a moment when this sender has no transfer open, and a try during which a
transfer opened is thrown away (`PROBE_TRIES` tries). A probe that could not finish (the
receiver did not answer within the timeout, or the sender never went idle) leaves the rate
unknown, and a transfer to that receiver at least `RETRY_S` later tries again. Every wait is
bounded: the backend's `timeout_s` per socket operation, `timeout_s` per wait for an idle
moment; `close` cancels a probe in progress.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from duet.kv_transfer.outbox import Outbox

logger = logging.getLogger(__name__)

PROBE_TRIES = 3
IDLE_POLL_S = 0.01  # between looks at whether a transfer is open
RETRY_S = 60.0  # after a probe that could not finish, before the next one to that receiver


class Probe(Protocol):
    """A backend's way of timing a burst to a receiver."""

    def measure(self, dest: str) -> float:
        """The rate of the link to receiver `dest` in GB/s. Raises (OSError, ...) when it
        cannot; every wait in it gives up after the sender's timeout."""
        ...

    def cancel(self) -> None:
        """Make a `measure` in progress on another thread end at once, and later ones fail."""
        ...


class LinkProber:
    """Runs `probe` once per receiver and keeps the rates in `outbox`, which reports them with
    every transfer's outcome. Thread-safe; `start` never blocks."""

    def __init__(self, probe: Probe, outbox: Outbox, name: str, timeout_s: float) -> None:
        self._probe = probe
        self._outbox = outbox
        self._name = name
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._not_before: dict[str, float] = {}  # receiver -> when it may be probed (again)
        self._threads: list[threading.Thread] = []

    def start(self, dest: str) -> None:
        """Measure the link to `dest` in the background, unless it is measured, being
        measured, or was tried less than `RETRY_S` ago."""
        now = time.monotonic()
        with self._lock:
            if self._stop.is_set() or now < self._not_before.get(dest, 0.0):
                return
            if self._outbox.link_gbps(dest) is not None:
                return
            self._not_before[dest] = float("inf")  # until this probe ends
            thread = threading.Thread(
                target=self._run, args=(dest,), name=f"kv-probe-{self._name}", daemon=True
            )
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _run(self, dest: str) -> None:
        gbps = None
        try:
            gbps = self._measure(dest)
        finally:
            if gbps is not None:
                self._outbox.set_link_gbps(dest, gbps)
                logger.info("KV link %s -> %s: %.3f GB/s (probed)", self._name, dest, gbps)
            with self._lock:
                self._not_before[dest] = time.monotonic() + RETRY_S

    def _measure(self, dest: str) -> float | None:
        for _ in range(PROBE_TRIES):
            opened = self._wait_idle()
            if opened is None:
                continue
            try:
                gbps = self._probe.measure(dest)
            except Exception as e:
                if not self._stop.is_set():
                    logger.warning("KV link probe %s -> %s failed: %s", self._name, dest, e)
                return None
            if self._outbox.activity()[1] == opened:  # nothing else went out meanwhile
                return gbps
        if not self._stop.is_set():
            logger.info("KV link probe %s -> %s: never alone on the link; later", self._name, dest)
        return None

    def _wait_idle(self) -> int | None:
        """Once no transfer is open: how many had opened by then. None when closing, or when
        none was that moment within `timeout_s`."""
        deadline = time.monotonic() + self._timeout_s
        while not self._stop.wait(IDLE_POLL_S):
            num_open, num_opened = self._outbox.activity()
            if num_open == 0:
                return num_opened
            if time.monotonic() >= deadline:
                return None
        return None

    def close(self) -> None:
        """Cancel probes in progress and wait (bounded) for their threads."""
        self._stop.set()
        self._probe.cancel()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=self._timeout_s)
