"""The worker's side of `DecodeWorker.Outputs`: each router opens one stream per worker, and
every request it starts names that stream. What the engine produced for all of the stream's
requests in one step leaves as one `OutputBatch`, not one message per request per token.

How one message per step falls out: the engine core hands a step's outputs to this event loop
in one callback (`engine/core.py`, `_flush`), which wakes each request's pump task in order.
Each pump appends its delta and sets the stream's event; the sender that the event wakes is
scheduled behind every pump woken by that callback, so it finds the whole step's items. A
slow reader only makes batches bigger: while one is being written, the next steps pile up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from contextlib import aclosing

import grpc

from duet.v1 import worker_pb2

logger = logging.getLogger(__name__)

StatusOf = Callable[[Exception], "grpc.StatusCode | None"]
"""Maps a request's exception to the gRPC status it ends with (None: unexpected)."""


class OutputStream:
    """One router's stream of outputs on this worker."""

    def __init__(self, stream_id: str) -> None:
        self.stream_id = stream_id
        self._items: list[worker_pb2.RequestOutputItem] = []
        self._wake = asyncio.Event()
        self._pumps: dict[str, asyncio.Task[None]] = {}
        self.num_batches = 0  # messages sent, the opening one excluded

    def start(
        self,
        request_id: str,
        outputs: AsyncIterable[worker_pb2.OutputDelta],
        status: StatusOf,
    ) -> None:
        """Forward `outputs` (an async generator, or anything with `aclose`) to this stream
        until it ends; an exception it raises becomes the request's error item (`status`
        maps it to a gRPC code). Raises `ValueError` for a request already on the stream."""
        if request_id in self._pumps:
            raise ValueError(f"request {request_id!r} is already running on this stream")
        task = asyncio.create_task(self._pump(request_id, outputs, status))
        task.add_done_callback(lambda t: _close_if_never_run(t, outputs))
        self._pumps[request_id] = task

    def abort(self, request_id: str) -> None:
        """Stop forwarding the request; closing its outputs aborts it in the engine."""
        task = self._pumps.get(request_id)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        """Abort every request still running on the stream and wait for their clean-up."""
        pumps = list(self._pumps.values())
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)

    async def batches(self) -> AsyncIterator[worker_pb2.OutputBatch]:
        """The empty opening batch, then one batch per wake-up with everything pending."""
        yield worker_pb2.OutputBatch()
        while True:
            await self._wake.wait()
            self._wake.clear()
            items, self._items = self._items, []
            if items:
                self.num_batches += 1
                yield worker_pb2.OutputBatch(items=items)

    async def _pump(
        self, request_id: str, outputs: AsyncIterable[worker_pb2.OutputDelta], status: StatusOf
    ) -> None:
        try:
            async with aclosing(outputs):  # type: ignore[type-var]
                async for delta in outputs:
                    self._push(worker_pb2.RequestOutputItem(request_id=request_id, output=delta))
        except asyncio.CancelledError:
            pass  # aborted (the router asked, or its stream ended): nobody to tell
        except Exception as e:
            code = status(e)
            if code is None:
                logger.exception("decode worker: request %s failed", request_id)
                code = grpc.StatusCode.INTERNAL
            error = worker_pb2.RequestError(code=code.value[0], details=str(e))
            self._push(worker_pb2.RequestOutputItem(request_id=request_id, error=error))
        finally:
            self._pumps.pop(request_id, None)

    def _push(self, item: worker_pb2.RequestOutputItem) -> None:
        self._items.append(item)
        self._wake.set()


def _close_if_never_run(
    task: asyncio.Task[None], outputs: AsyncIterable[worker_pb2.OutputDelta]
) -> None:
    """A pump cancelled before its first step never closed its outputs: close them now (the
    request is aborted and its blocks freed)."""
    if task.cancelled():
        closing = asyncio.ensure_future(outputs.aclose())  # type: ignore[attr-defined]
        _closing.add(closing)
        closing.add_done_callback(_closing.discard)


_closing: set[asyncio.Future[None]] = set()


class OutputStreams:
    """The open `Outputs` streams of one worker, by id."""

    def __init__(self) -> None:
        self._streams: dict[str, OutputStream] = {}

    def open(self, stream_id: str) -> OutputStream:
        """Raises `KeyError` when the id is empty or already open."""
        if not stream_id or stream_id in self._streams:
            raise KeyError(stream_id)
        stream = OutputStream(stream_id)
        self._streams[stream_id] = stream
        return stream

    def get(self, stream_id: str) -> OutputStream | None:
        return self._streams.get(stream_id)

    async def close(self, stream: OutputStream) -> None:
        if self._streams.get(stream.stream_id) is stream:
            del self._streams[stream.stream_id]
        await stream.close()
