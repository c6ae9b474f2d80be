"""Waiting for a condition in tests, bounded: never a fixed sleep that hopes it came true."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.01
) -> T:
    """Call `predicate` every `interval_s` until it returns something truthy, and return that.

    Raises AssertionError naming `what` (say what is awaited: "the decode worker back") if it
    has not within `timeout_s`. Exceptions from `predicate` propagate at once."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)
    return value


async def wait_for_async(
    predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.01
) -> T:
    """`wait_for` inside a coroutine: waits with `asyncio.sleep`, so the event loop's other
    tasks (servers, pollers) run meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)
    return value
