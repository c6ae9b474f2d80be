"""The router's client of a prefill worker (`duet.v1.PrefillWorker` over gRPC; the decode
side is decode_client.py). Every call carries a deadline and fresh credentials of the
cluster secret (cluster_auth/grpc_auth.py)."""

from __future__ import annotations

from dataclasses import dataclass

from duet.cluster_auth import ClusterSecret, load_cluster_secret
from duet.cluster_auth.grpc_auth import CallSigner
from duet.cluster_auth.tls import internal_channel
from duet.engine.outputs import PromptLogprob
from duet.kv_transfer import TransferStatus
from duet.telemetry.request_trace import request_trace_metadata
from duet.v1 import worker_pb2, worker_pb2_grpc
from duet.wire.deltas import prompt_logprobs_from_proto

_STATUSES = {
    worker_pb2.TRANSFER_OUTCOME_DONE: TransferStatus.DONE,
    worker_pb2.TRANSFER_OUTCOME_FAILED: TransferStatus.FAILED,
    worker_pb2.TRANSFER_OUTCOME_ABORTED: TransferStatus.ABORTED,
}

_PREFILL = "/" + worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name + "/"

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


@dataclass(frozen=True)
class PrefillOutcome:
    status: TransferStatus
    error: str
    retryable: bool
    first_token: int
    num_cached_tokens: int
    num_transfer_bytes: int = 0
    transfer_s: float = 0.0
    prompt_logprobs: list[PromptLogprob | None] | None = None
    num_transfer_chunks: int = 0
    link_gbps: float = 0.0  # 0: not measured (worker.proto)


class PrefillClient:
    def __init__(self, address: str, secret: ClusterSecret | None = None) -> None:
        """`secret`: the cluster's (default: this process's, `load_cluster_secret`)."""
        self.address = address
        self.signer = CallSigner(secret or load_cluster_secret())
        self.channel = internal_channel(address, CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.PrefillWorkerStub(self.channel)

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: worker_pb2.SamplingParams,
        kv_destination: str,
        timeout_s: float,
        num_replayed: int = 0,
        priority: int = 0,
    ) -> PrefillOutcome:
        """Raises `grpc.aio.AioRpcError` when the worker is unreachable, refuses the input
        (INVALID_ARGUMENT) or the deadline passes. `params`: wire/sampling.py's;
        `num_replayed`: see worker.proto."""
        response = await self.stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                sampling=params,
                kv_destination=kv_destination,
                num_replayed=num_replayed,
                priority=priority,
            ),
            timeout=timeout_s,
            metadata=(*self.signer.metadata(_PREFILL + "Prefill"), *request_trace_metadata()),
        )
        return PrefillOutcome(
            _STATUSES[response.outcome],
            response.error,
            response.retryable,
            response.first_token,
            response.num_cached_tokens,
            response.num_transfer_bytes,
            response.transfer_s,
            prompt_logprobs_from_proto(response.prompt_logprobs),
            response.num_transfer_chunks,
            response.link_gbps,
        )

    async def load(self, since_event: int = 0, timeout_s: float = 2.0) -> worker_pb2.PrefillLoad:
        return await self.stub.GetLoad(
            worker_pb2.LoadRequest(since_event=since_event),
            timeout=timeout_s,
            metadata=self.signer.metadata(_PREFILL + "GetLoad"),
        )

    async def close(self) -> None:
        await self.channel.close()
