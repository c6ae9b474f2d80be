"""Cancel a non-streaming request's work when its client goes away.

A streaming response notices a gone client when Starlette stops iterating its body; a plain
request does not, so its generation would run to the end for nobody. `run_until_disconnect`
races the work against the ASGI `http.disconnect` message and cancels the loser (which aborts
the engine request and frees its blocks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499
"""Status logged for a request whose client left first (nginx's convention); nobody reads it."""


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    # The body was read already, so the next message is the disconnect (uvicorn sends it only
    # when the connection drops).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; raise `ClientDisconnected` (after cancelling it) if the client leaves."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also reached when this handler is cancelled (server shutdown): stop both.
        for task in (watch_task, work_task):
            if not task.done():
                task.cancel()
        await asyncio.gather(watch_task, work_task, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()
