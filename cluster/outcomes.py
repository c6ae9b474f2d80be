"""Every way an attempt can fail, classified in one table (`OUTCOMES`) into what it means for
the request and for the worker it failed on.

A failure is named by the side it came from (the prefill or the decode worker) and its cause:
the gRPC status a call or a request's stream ended with, the status of the KV transfer the
prefill worker reported, or the decode stream ending before the sample finished. What the table
does not name is `Outcome.RETRY`: another attempt, on whatever workers the pool picks then.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias

import grpc

from duet.kv_transfer import TransferStatus


class Outcome(enum.Enum):
    """What a failed attempt means."""

    RETRY = "retry"
    """Another attempt may succeed (the KV never came, an unexpected error)."""
    WORKER_LOST = "worker_lost"
    """The worker is unreachable: it gets no new requests until a poll answers again; retry."""
    WORKER_FULL = "worker_full"
    """The decode worker has no room: skipped for `FULL_BACKOFF_S`. Not a failure: the request
    waits for room (backing off, bounded by its own timeout) and tries again without spending
    one of its attempts."""
    INVALID_INPUT = "invalid_input"
    """The request itself is refused: a 400 / INVALID_ARGUMENT naming the prompt, no retry."""
    TIMED_OUT = "timed_out"
    """The request's deadline passed: a retryable 503 / UNAVAILABLE, no further attempt."""


class Side(enum.Enum):
    PREFILL = "prefill worker"
    DECODE = "decode worker"


STREAM_ENDED_EARLY = "stream ended early"
"""The cause of a decode stream that ended before its sample finished."""
NO_PROMPT_LOGPROBS = "no prompt logprobs"
"""The cause of a prefill worker's answer without the prompt logprobs the request asked for."""
KV_ADDRESS_MOVED = "kv address moved"
"""The cause of a reservation whose KV address is not the one the prefill call (started beside
it, from the decode worker's load report) sends to: the worker restarted in between."""

Cause: TypeAlias = grpc.StatusCode | TransferStatus | str

OUTCOMES: Mapping[tuple[Side, Cause], Outcome] = {
    (Side.DECODE, grpc.StatusCode.INVALID_ARGUMENT): Outcome.INVALID_INPUT,
    (Side.DECODE, grpc.StatusCode.RESOURCE_EXHAUSTED): Outcome.WORKER_FULL,
    (Side.DECODE, grpc.StatusCode.DEADLINE_EXCEEDED): Outcome.TIMED_OUT,
    (Side.DECODE, grpc.StatusCode.UNAVAILABLE): Outcome.WORKER_LOST,
    (Side.DECODE, grpc.StatusCode.CANCELLED): Outcome.WORKER_LOST,
    (Side.DECODE, STREAM_ENDED_EARLY): Outcome.WORKER_LOST,
    (Side.DECODE, KV_ADDRESS_MOVED): Outcome.RETRY,
    # ABORTED: the KV never arrived; the decode worker is fine.
    (Side.DECODE, grpc.StatusCode.ABORTED): Outcome.RETRY,
    (Side.PREFILL, grpc.StatusCode.INVALID_ARGUMENT): Outcome.INVALID_INPUT,
    (Side.PREFILL, grpc.StatusCode.UNAVAILABLE): Outcome.WORKER_LOST,
    (Side.PREFILL, grpc.StatusCode.CANCELLED): Outcome.WORKER_LOST,
    # NOTE: a prefill call past its deadline (bounded by the KV wait) is the transfer's
    # failure, not the request's: another attempt still has time.
    (Side.PREFILL, grpc.StatusCode.DEADLINE_EXCEEDED): Outcome.RETRY,
    (Side.PREFILL, TransferStatus.FAILED): Outcome.RETRY,
    (Side.PREFILL, TransferStatus.ABORTED): Outcome.RETRY,
    (Side.PREFILL, NO_PROMPT_LOGPROBS): Outcome.RETRY,
}

FULL_BACKOFF_S = 0.2
"""How long a decode worker that refused a reservation for lack of room is skipped."""


@dataclass(frozen=True)
class Failure:
    """One failure of an attempt, as the table classifies it."""

    side: Side
    worker: str
    cause: Cause | None
    """The table's key; None for an error that is none of the known causes (`Outcome.RETRY`)."""
    message: str
    """Why, for the log, the retry's reason and the request's error (names the worker)."""
    details: str = ""
    """What the worker said (an RPC's details), for an error naming the request's field."""

    @property
    def outcome(self) -> Outcome:
        if self.cause is None:
            return Outcome.RETRY
        return OUTCOMES.get((self.side, self.cause), Outcome.RETRY)

    @classmethod
    def of_rpc(cls, side: Side, worker: str, error: grpc.aio.AioRpcError) -> Failure:
        code, details = error.code(), error.details() or ""
        return cls(side, worker, code, f"{side.value} {worker}: {code.name}: {details}", details)

    @classmethod
    def of_error(cls, side: Side, worker: str, error: BaseException) -> Failure:
        """Any exception: an RPC's by its status, the rest `Outcome.RETRY`."""
        if isinstance(error, grpc.aio.AioRpcError):
            return cls.of_rpc(side, worker, error)
        return cls(side, worker, None, f"{side.value} {worker}: {error!r}")

    @classmethod
    def of_transfer(cls, worker: str, status: TransferStatus, error: str) -> Failure:
        """The prefill worker's answer: the KV transfer did not end DONE."""
        message = f"{Side.PREFILL.value} {worker}: KV transfer {status.value}: {error}"
        return cls(Side.PREFILL, worker, status, message)

    @classmethod
    def stream_ended(cls, worker: str) -> Failure:
        message = f"{Side.DECODE.value} {worker} ended the stream early"
        return cls(Side.DECODE, worker, STREAM_ENDED_EARLY, message)

    @classmethod
    def no_prompt_logprobs(cls, worker: str) -> Failure:
        message = f"{Side.PREFILL.value} {worker} sent no prompt logprobs"
        return cls(Side.PREFILL, worker, NO_PROMPT_LOGPROBS, message)

    @classmethod
    def kv_address_moved(cls, worker: str, address: str) -> Failure:
        message = f"{Side.DECODE.value} {worker} moved its KV address to {address!r}"
        return cls(Side.DECODE, worker, KV_ADDRESS_MOVED, message)
