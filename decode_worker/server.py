"""The decode worker's gRPC service (`duet.v1.DecodeWorker`) plus standard health checking.

Status codes (of the call, or of a request's error item on its `Outputs` stream): no room
for the prompt -> RESOURCE_EXHAUSTED (try another worker); the KV never arrived -> ABORTED
(retry with another prefill); the worker is stopping -> UNAVAILABLE; bad input ->
INVALID_ARGUMENT. A router that aborts a request, or closes its `Outputs` stream, frees the
blocks of what it aborted (output_streams.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from typing import NoReturn

import grpc
from opentelemetry import trace

from duet.cluster_auth import ClusterSecret
from duet.cluster_auth.internal_server import start_internal_server
from duet.decode_worker.output_streams import OutputStream, OutputStreams
from duet.decode_worker.worker import DecodeWorker, KVTransferError, NoCapacityError
from duet.engine import InvalidInputError
from duet.engine.async_engine import EngineDeadError
from duet.telemetry.otel import remote_parent, worker_tracer
from duet.telemetry.worker_spans import TracedOutputs
from duet.telemetry.worker_stats import worker_stats
from duet.v1 import worker_pb2, worker_pb2_grpc
from duet.wire.sampling import sampling_from_proto

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker, tracer: trace.Tracer | None = None) -> None:
        """`tracer`: records the spans of calls that carry a trace context (None: none)."""
        self.worker = worker
        self.tracer = tracer
        self.worker_id = uuid.uuid4().hex
        self.streams = OutputStreams()

    async def Outputs(
        self, request: worker_pb2.OutputsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.OutputBatch]:
        try:
            stream = self.streams.open(request.stream_id)
        except KeyError:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"stream_id {request.stream_id!r} is empty or already open",
            )
        try:
            async for batch in stream.batches():
                yield batch
        finally:  # the router closed it or went away: its requests end here
            await self.streams.close(stream)

    async def DecodeRemote(
        self, request: worker_pb2.DecodeRemoteRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.Reserved:
        received_ns = time.time_ns()
        stream = await self._stream(request.stream_id, context)
        try:
            params = sampling_from_proto(request.sampling)
            remote = await self.worker.reserve_deltas(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                request.kv_wait_s or None,
                request.num_replayed,
                request.priority,
            )
        except Exception as e:
            await _abort(context, e)
        reservation = remote.reservation
        try:
            outputs = self._traced(remote, context, request.request_id, "kv_wait", received_ns)
            stream.start(request.request_id, outputs, _status)
        except ValueError as e:
            await remote.aclose()
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        return worker_pb2.Reserved(
            kv_address=reservation.kv_address, num_blocks=reservation.num_blocks
        )

    async def Generate(
        self, request: worker_pb2.LocalGenerateRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.Started:
        received_ns = time.time_ns()
        stream = await self._stream(request.stream_id, context)
        try:
            params = sampling_from_proto(request.sampling)
        except InvalidInputError as e:  # a ValueError too: not the duplicate id below
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        outputs = self.worker.generate_deltas(
            request.prompt_token_ids,
            params,
            request.request_id,
            priority=request.priority,
            num_replayed=request.num_replayed,
        )  # an async generator: what it refuses ends the request on the stream
        traced = self._traced(outputs, context, request.request_id, "prefill", received_ns)
        try:
            stream.start(request.request_id, traced, _status)
        except ValueError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        return worker_pb2.Started()

    async def Abort(
        self, request: worker_pb2.AbortDecodeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.Aborted:
        stream = self.streams.get(request.stream_id)
        if stream is not None:
            stream.abort(request.request_id)
        return worker_pb2.Aborted()

    def _traced(
        self,
        outputs: AsyncIterable[worker_pb2.OutputDelta],
        context: grpc.aio.ServicerContext,
        request_id: str,
        first_phase: str,
        received_ns: int,
    ) -> AsyncIterable[worker_pb2.OutputDelta]:
        """`outputs`, recording the request's spans when the call carried a trace context."""
        parent = remote_parent(context.invocation_metadata()) if self.tracer else None
        if parent is None or self.tracer is None:
            return outputs
        return TracedOutputs(
            outputs, self.tracer, parent, self.worker.name, request_id, first_phase, received_ns
        )

    async def _stream(self, stream_id: str, context: grpc.aio.ServicerContext) -> OutputStream:
        stream = self.streams.get(stream_id)
        if stream is not None:
            return stream
        await context.abort(
            grpc.StatusCode.NOT_FOUND, f"no open Outputs stream with stream_id {stream_id!r}"
        )
        raise AssertionError("unreachable: abort raises")

    async def GetLoad(
        self, request: worker_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DecodeLoad:
        if not self.worker.is_running:  # the load poll doubles as the health check
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is not running")
        load = self.worker.load
        return worker_pb2.DecodeLoad(
            worker_id=self.worker_id,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_waiting_for_kv=load.num_waiting_for_kv,
            num_free_blocks=load.num_free_blocks,
            num_blocks=load.num_blocks,
            max_num_seqs=load.max_num_seqs,
            block_size=self.worker.config.block_size,
            kv_address=self.worker.kv_address,
            deterministic=self.worker.deterministic,
            stats=worker_stats(self.worker.engine.stats),
            ngram=self.worker.speculates_with_ngram,
        )


def _status(error: Exception) -> grpc.StatusCode | None:
    """The status a request's failure ends it with; None for an unexpected one."""
    if isinstance(error, InvalidInputError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, NoCapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, KVTransferError):  # this worker is fine; the KV's sender is not
        return grpc.StatusCode.ABORTED
    if isinstance(error, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE
    return None


async def _abort(context: grpc.aio.ServicerContext, error: Exception) -> NoReturn:
    code = _status(error)
    if code is not None:
        await context.abort(code, str(error))
    raise error


async def start_decode_server(
    worker: DecodeWorker,
    host: str = "127.0.0.1",
    port: int = 0,
    secret: ClusterSecret | None = None,
    tracer: trace.Tracer | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Serve `worker` on `host:port` (0: a free port), refusing calls without credentials of
    `secret` (default: this process's cluster secret; health checks stay open). Returns the
    started server and port. `tracer`: for traced calls' spans (default: from
    `DUET_OTLP_ENDPOINT`, telemetry/otel.py; unset: no tracing)."""
    servicer = DecodeServicer(worker, tracer or worker_tracer("duet-decode-worker"))
    return await start_internal_server(
        "decode worker", SERVICE_NAME,
        lambda server: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server),
        host, port, secret,
    )  # fmt: skip
