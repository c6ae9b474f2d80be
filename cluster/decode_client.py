"""The router's client of one decode worker (`duet.v1.DecodeWorker`).

All of this router's requests on the worker share one `Outputs` stream, which brings what
each engine step produced for all of them in one message (decode_worker/output_streams.py).
A request is started by a unary call naming the stream (`DecodeRemote` or `Generate`) and
read as a `DecodeStream`, which raises `grpc.aio.AioRpcError` with the status the request
ended with, exactly as a call of its own would: the request's error item, UNAVAILABLE when
the shared stream broke, DEADLINE_EXCEEDED past the request's deadline. Every call carries a
deadline and fresh credentials of the cluster secret (cluster_auth/grpc_auth.py)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from duet.cluster.prefill_client import CHANNEL_OPTIONS
from duet.cluster_auth import ClusterSecret, load_cluster_secret
from duet.cluster_auth.grpc_auth import CallSigner
from duet.cluster_auth.tls import internal_channel
from duet.telemetry.request_trace import request_trace_metadata
from duet.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

_DECODE = "/" + worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name + "/"
ABORT_TIMEOUT_S = 5.0


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


_CODES = {code.value[0]: code for code in grpc.StatusCode}

REFUSED = frozenset({
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
})  # fmt: skip
"""Codes a decode worker answers a start call with before it holds anything for the request
(decode_worker/server.py): no abort needed."""


class _SharedStream:
    """One open `Outputs` call and the queues of the requests started on it."""

    def __init__(self, stream_id: str, call: grpc.aio.UnaryStreamCall, address: str) -> None:
        self.stream_id = stream_id
        self.call = call
        self.address = address
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        # requests whose last item (the output with a finish reason, or an error) has not
        # arrived: they run on the worker as far as this router knows
        self.unfinished: set[str] = set()
        self.broken: grpc.aio.AioRpcError | None = None
        self.reader = asyncio.create_task(self._read())

    def register(self, request_id: str) -> asyncio.Queue[Any]:
        if self.broken is not None:
            raise self.broken
        if request_id in self.queues:
            raise rpc_error(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is running")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[request_id] = queue
        self.unfinished.add(request_id)
        return queue

    def forget(self, request_id: str) -> None:
        self.queues.pop(request_id, None)
        self.unfinished.discard(request_id)

    async def _read(self) -> None:
        error = rpc_error(
            grpc.StatusCode.UNAVAILABLE, f"decode worker {self.address} ended the output stream"
        )
        try:
            while True:
                batch = await self.call.read()
                if batch is grpc.aio.EOF:
                    break
                for item in batch.items:
                    queue = self.queues.get(item.request_id)
                    if queue is None:
                        continue  # aborted here: its last outputs are of no use
                    if item.WhichOneof("kind") == "output":
                        queue.put_nowait(item.output)
                        if item.output.finish_reason:
                            self.unfinished.discard(item.request_id)
                    else:
                        code = _CODES.get(item.error.code, grpc.StatusCode.UNKNOWN)
                        queue.put_nowait(rpc_error(code, item.error.details))
                        self.unfinished.discard(item.request_id)
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the decode client was closed")
            raise
        finally:
            self.broken = error
            for queue in self.queues.values():
                queue.put_nowait(error)
            self.queues.clear()
            self.unfinished.clear()

    async def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)


class DecodeStream:
    """One request's outputs from a decode worker; `cancel` aborts it there."""

    def __init__(
        self,
        client: DecodeClient,
        shared: _SharedStream,
        request_id: str,
        queue: asyncio.Queue[Any],
        deadline: float,
        reserved: worker_pb2.Reserved | None,
    ) -> None:
        self.client = client
        self.shared = shared
        self.request_id = request_id
        self.queue = queue
        self.deadline = deadline
        self.reserved = reserved
        self._over = False

    async def deltas(self) -> AsyncIterator[worker_pb2.OutputDelta]:
        """The request's deltas until the one with a finish reason."""
        while not self._over:
            remaining = self.deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError
                item = await asyncio.wait_for(self.queue.get(), remaining)
            except TimeoutError:
                self.cancel()
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None
            if isinstance(item, grpc.aio.AioRpcError):
                self._end()
                raise item
            if item.finish_reason:
                self._end()
            yield item

    def cancel(self) -> None:
        """Abort the request on the worker (in the background) unless it is over."""
        if self._over:
            return
        self._end()
        self.client.abort_later(self.shared, self.request_id)

    def _end(self) -> None:
        self._over = True
        self.shared.forget(self.request_id)


class DecodeClient:
    def __init__(self, address: str, secret: ClusterSecret | None = None) -> None:
        """`secret`: the cluster's (default: this process's, `load_cluster_secret`)."""
        self.address = address
        self.signer = CallSigner(secret or load_cluster_secret())
        self.channel = internal_channel(address, CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.DecodeWorkerStub(self.channel)
        self._shared: _SharedStream | None = None
        self._opening = asyncio.Lock()
        self._aborts: set[asyncio.Task[None]] = set()

    async def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: worker_pb2.SamplingParams,
        kv_wait_s: float,
        timeout_s: float,
        num_replayed: int = 0,
        priority: int = 0,
    ) -> DecodeStream:
        """Reserve blocks for a remote prefill. Raises `grpc.aio.AioRpcError`
        (RESOURCE_EXHAUSTED: no room there) before anything was reserved. A call cancelled
        or failed otherwise (its deadline) asks the worker to abort: it may have granted the
        reservation after the router gave up, which would hold its blocks until `kv_wait_s`."""
        deadline = time.monotonic() + timeout_s
        shared, queue = await self._register(request_id, timeout_s)
        try:
            reserved = await self.stub.DecodeRemote(
                worker_pb2.DecodeRemoteRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt_token_ids,
                    sampling=params,
                    kv_wait_s=kv_wait_s,
                    num_replayed=num_replayed,
                    stream_id=shared.stream_id,
                    priority=priority,
                ),
                timeout=max(0.0, deadline - time.monotonic()),
                metadata=(
                    *self.signer.metadata(_DECODE + "DecodeRemote"),
                    *request_trace_metadata(),
                ),
            )
        except BaseException as e:
            self._unstarted(shared, request_id, e)
            raise
        return DecodeStream(self, shared, request_id, queue, deadline, reserved)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: worker_pb2.SamplingParams,
        timeout_s: float,
        num_replayed: int = 0,
        priority: int = 0,
    ) -> DecodeStream:
        """Prefill and decode on the worker. Raises `grpc.aio.AioRpcError` when it refuses
        the request; later failures are raised by the stream."""
        deadline = time.monotonic() + timeout_s
        shared, queue = await self._register(request_id, timeout_s)
        try:
            await self.stub.Generate(
                worker_pb2.LocalGenerateRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt_token_ids,
                    sampling=params,
                    num_replayed=num_replayed,
                    stream_id=shared.stream_id,
                    priority=priority,
                ),
                timeout=max(0.0, deadline - time.monotonic()),
                metadata=(*self.signer.metadata(_DECODE + "Generate"), *request_trace_metadata()),
            )
        except BaseException as e:
            self._unstarted(shared, request_id, e)
            raise
        return DecodeStream(self, shared, request_id, queue, deadline, None)

    @property
    def num_streams(self) -> int:
        """Requests of this router running on the worker as far as its outputs tell: started,
        and neither their last output nor an error has arrived. Unlike the worker's load
        report (`num_running`, a poll old), it is current to the last message read; it counts
        a request reserved for a remote prefill from the reservation on."""
        shared = self._shared
        return 0 if shared is None or shared.broken is not None else len(shared.unfinished)

    async def load(self, timeout_s: float = 2.0) -> worker_pb2.DecodeLoad:
        return await self.stub.GetLoad(
            worker_pb2.LoadRequest(),
            timeout=timeout_s,
            metadata=self.signer.metadata(_DECODE + "GetLoad"),
        )

    def _unstarted(self, shared: _SharedStream, request_id: str, error: BaseException) -> None:
        """A start call (`DecodeRemote`, `Generate`) ended without its reply: stop routing the
        request's outputs and, unless the worker refused it outright, abort it there."""
        shared.forget(request_id)
        if not (isinstance(error, grpc.aio.AioRpcError) and error.code() in REFUSED):
            self.abort_later(shared, request_id)

    def abort_later(self, shared: _SharedStream, request_id: str) -> None:
        """Ask the worker to abort a request, without waiting (from `DecodeStream.cancel`)."""
        if shared.broken is not None:
            return  # the stream's end already aborted everything on it
        task = asyncio.get_running_loop().create_task(self._abort(shared.stream_id, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def close(self) -> None:
        if self._shared is not None:
            await self._shared.close()
        await self.channel.close()

    async def _abort(self, stream_id: str, request_id: str) -> None:
        try:
            await self.stub.Abort(
                worker_pb2.AbortDecodeRequest(request_id=request_id, stream_id=stream_id),
                timeout=ABORT_TIMEOUT_S,
                metadata=self.signer.metadata(_DECODE + "Abort"),
            )
        except grpc.aio.AioRpcError as e:  # the worker is gone: so is the request
            logger.debug("abort of %s on %s failed: %s", request_id, self.address, e.code())

    async def _register(
        self, request_id: str, timeout_s: float
    ) -> tuple[_SharedStream, asyncio.Queue[Any]]:
        """The open shared stream (opened, or reopened after it broke) and the request's
        queue on it, registered before the request starts: outputs may overtake the reply."""
        shared = self._shared
        if shared is None or shared.broken is not None:
            shared = await self._open(timeout_s)
        return shared, shared.register(request_id)

    async def _open(self, timeout_s: float) -> _SharedStream:
        async with self._opening:
            if self._shared is not None and self._shared.broken is None:
                return self._shared
            stream_id = uuid.uuid4().hex
            call = self.stub.Outputs(
                worker_pb2.OutputsRequest(stream_id=stream_id),
                metadata=self.signer.metadata(_DECODE + "Outputs"),
            )
            try:  # the opening (empty) batch: the worker knows the stream now
                first = await asyncio.wait_for(call.read(), timeout_s)
            except TimeoutError:
                call.cancel()
                raise rpc_error(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"decode worker {self.address} did not open an output stream",
                ) from None
            except BaseException:
                call.cancel()
                raise
            if first is grpc.aio.EOF:
                raise rpc_error(
                    grpc.StatusCode.UNAVAILABLE,
                    f"decode worker {self.address} refused an output stream",
                )
            self._shared = _SharedStream(stream_id, call, self.address)
            return self._shared
