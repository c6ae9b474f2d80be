"""The prefill worker's gRPC service (`duet.v1.PrefillWorker`) plus standard health checking.
Rank 0 of a tensor-parallel group serves it; the other ranks only follow."""

from __future__ import annotations

import logging
import time
import uuid

import grpc
from opentelemetry import trace

from duet.cluster_auth import ClusterSecret
from duet.cluster_auth.internal_server import start_internal_server
from duet.engine import InvalidInputError
from duet.kv_transfer import TransferStatus
from duet.prefill_worker.worker import PrefillWorker
from duet.telemetry.otel import remote_parent, worker_tracer
from duet.telemetry.worker_spans import record_prefill
from duet.telemetry.worker_stats import worker_stats
from duet.v1 import worker_pb2, worker_pb2_grpc
from duet.wire.deltas import prompt_logprobs_to_proto
from duet.wire.sampling import sampling_from_proto

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name

OUTCOMES = {
    TransferStatus.DONE: worker_pb2.TRANSFER_OUTCOME_DONE,
    TransferStatus.FAILED: worker_pb2.TRANSFER_OUTCOME_FAILED,
    TransferStatus.ABORTED: worker_pb2.TRANSFER_OUTCOME_ABORTED,
}


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker, tracer: trace.Tracer | None = None) -> None:
        """`tracer`: records the spans of calls that carry a trace context (None: none)."""
        self.worker = worker
        self.worker_id = uuid.uuid4().hex  # a restarted worker has a new id and an empty cache
        self.tracer = tracer
        worker.role.record_queue_times = tracer is not None  # the queue span's end

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        if not self.worker.is_running:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker is not running")
        received_ns = time.time_ns()
        parent = remote_parent(context.invocation_metadata()) if self.tracer else None
        try:
            params = sampling_from_proto(request.sampling)
            result = await self.worker.prefill(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                request.kv_destination,
                request.num_replayed,
                request.priority,
            )
        except InvalidInputError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ValueError as e:  # a duplicate request id
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        if parent is not None and self.tracer is not None:
            record_prefill(self.tracer, parent, self.worker.name, received_ns, result)
        return worker_pb2.PrefillResponse(
            outcome=OUTCOMES[result.status],
            error=result.error or "",
            retryable=result.retryable,
            first_token=result.first_token or 0,
            num_cached_tokens=result.num_cached_tokens,
            num_transfer_bytes=result.num_transfer_bytes,
            transfer_s=result.transfer_s,
            prompt_logprobs=prompt_logprobs_to_proto(
                result.prompt_logprobs or [], request.prompt_token_ids
            ),
            num_transfer_chunks=result.num_transfer_chunks,
            link_gbps=result.link_gbps,
        )

    async def GetLoad(
        self, request: worker_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillLoad:
        if not self.worker.is_running:  # the load poll doubles as the health check
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker is not running")
        load = self.worker.load
        delta = self.worker.prefix_index.since(request.since_event)
        return worker_pb2.PrefillLoad(
            worker_id=self.worker_id,
            num_waiting=load.num_waiting,
            num_running=load.num_running,
            num_transferring=load.num_transferring,
            num_queued_tokens=load.num_queued_tokens,
            num_free_blocks=load.num_free_blocks,
            num_blocks=load.num_blocks,
            block_size=self.worker.config.block_size,
            last_event=delta.last_event,
            snapshot=delta.snapshot,
            stored_hashes=delta.stored,
            removed_hashes=delta.removed,
            deterministic=self.worker.deterministic,
            stats=worker_stats(self.worker.engine.stats),
        )


async def start_prefill_server(
    worker: PrefillWorker,
    host: str = "127.0.0.1",
    port: int = 0,
    secret: ClusterSecret | None = None,
    tracer: trace.Tracer | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Serve `worker` on `host:port` (0: a free port), refusing calls without credentials of
    `secret` (default: this process's cluster secret; health checks stay open). Returns the
    started server and port. `tracer`: for traced calls' spans (default: from
    `DUET_OTLP_ENDPOINT`, telemetry/otel.py; unset: no tracing)."""
    servicer = PrefillServicer(worker, tracer or worker_tracer("duet-prefill-worker"))
    return await start_internal_server(
        "prefill worker", SERVICE_NAME,
        lambda server: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server),
        host, port, secret,
    )  # fmt: skip
