"""A stop request by signal (SIGTERM, SIGINT) that a supervising loop can wait on, safely.

The obvious way, a handler that calls `threading.Event.set`, can deadlock: a Python signal
handler runs in the main thread between two bytecodes, possibly while that thread holds the
same Event's internal lock inside `Event.wait`. Raising from the handler instead lets the
exception surface inside whatever library call the loop is in, which may catch it. Here the
handler only sets a flag, and the loop sleeps in `select` on a pipe that the interpreter's
C-level handler writes a byte to (`signal.set_wakeup_fd`), so a signal ends the wait at once;
a call in flight (bounded by its own timeout) finishes first.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Iterable
from typing import Any, Protocol


class Stopper(Protocol):
    """What a supervising loop waits on: `StopSignal`, or a `threading.Event` (tests)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class StopSignal:
    """`is_set()` / `wait(timeout)` like a `threading.Event`, set by the given signals (main
    thread only, as `signal.signal` requires). `restore()` puts the previous handlers back."""

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopSignal must be created in the main thread")
        self._set = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._previous_fd = signal.set_wakeup_fd(self._write)
        self._previous: dict[int, Any] = {s: signal.signal(s, self._on_signal) for s in signals}

    def _on_signal(self, signum: int, frame: object) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Until a stop signal or `timeout` seconds; True when stopped."""
        if not self._set:
            select.select([self._read], [], [], timeout)
            try:
                while os.read(self._read, 512):
                    pass
            except BlockingIOError:
                pass
        return self._set

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read)
        os.close(self._write)
