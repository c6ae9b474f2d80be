"""Merge the output streams of a multi-prompt completion into one, tagged by prompt index."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import TypeVar

T = TypeVar("T")


class _End:
    """Marks the end of one stream in the merge queue."""


_END = _End()


async def merge_streams(
    streams: Sequence[AsyncGenerator[T, None]],
) -> AsyncGenerator[tuple[int, T], None]:
    """Yield `(index, item)` as items arrive from any stream. The first error ends the merge;
    closing the merge (or an error) closes every stream, which aborts its engine request."""
    if len(streams) == 1:  # the common case: no tasks
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return

    queue: asyncio.Queue[tuple[int, T | _End | Exception]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream) as it:
                async for item in it:
                    queue.put_nowait((index, item))
            queue.put_nowait((index, _END))
        except Exception as e:
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, entry = await queue.get()
            if isinstance(entry, _End):
                remaining -= 1
            elif isinstance(entry, Exception):
                raise entry
            else:
                yield index, entry
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
