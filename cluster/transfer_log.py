"""`TransferLog`: the KV transfers a router saw, for /metrics and the dashboard.

The router learns each transfer's outcome from the prefill worker's answer to `Prefill` (its
status, the request's KV bytes over every TP rank, and the time from the end of the prefill
to the decode side's acknowledgement), or, when the attempt failed first (a decode worker
lost mid-transfer), from the attempt's error, and, once the prefill worker's sender has probed
its link to that decode worker (docs/kv_transfer.md), that link's rate: the latest per
(prefill worker, decode worker) is a gauge, and each completed transfer's achieved rate as a
fraction of it a histogram. Request migrations (retries on another worker) are counted by
cause. Everything is read at scrape time by `TransferCollector` (router/transfer_metrics.py);
recording happens on the router's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass

import grpc

from duet.cluster.prefill_client import PrefillOutcome
from duet.kv_transfer import TransferStatus
from duet.telemetry.request_trace import REQUEST_TRACE, AttemptTiming

DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                      10.0, 30.0, 60.0)  # fmt: skip
BANDWIDTH_BUCKETS_GBPS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0,
                          200.0, 400.0)  # fmt: skip
LINK_FRACTION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0,
                         1.5, 2.0, 4.0)  # fmt: skip
"""Above 1 with TP > 1: the link is rank 0's, the bytes every rank's (docs/observability.md)."""


@dataclass(frozen=True)
class TransferRecord:
    """One KV transfer that ended."""

    request_id: str
    prefill_worker: str
    decode_worker: str
    status: str
    """done, failed, aborted, or cancelled (the request ended before the answer came)."""
    reason: str
    """Why it failed ("" unless failed): timeout, peer_lost, decode_lost, an RPC code, ..."""
    num_bytes: int
    duration_s: float
    finished_at: float
    """Wall-clock time (seconds since the epoch)."""
    link_gbps: float = 0.0
    """The probed rate of the link the transfer went over, GB/s (0: not measured)."""

    @property
    def gbps(self) -> float:
        """Achieved bandwidth in GB/s (0 when unknown)."""
        if self.status != "done" or self.duration_s <= 0:
            return 0.0
        return self.num_bytes / self.duration_s / 1e9

    @property
    def link_fraction(self) -> float | None:
        """Achieved bandwidth over the link's probed rate (None: not done, or not measured)."""
        if self.status != "done" or self.duration_s <= 0 or self.link_gbps <= 0:
            return None
        return self.gbps / self.link_gbps


@dataclass
class TransferHandle:
    """One transfer in flight, from `TransferLog.begin` to `TransferLog.end`."""

    request_id: str
    prefill_worker: str
    decode_worker: str
    num_prompt_tokens: int
    timing: AttemptTiming | None = None  # when the request is traced


class TransferLog:
    def __init__(self, num_recent: int = 200, num_history: int = 50_000) -> None:
        self.recent: deque[TransferRecord] = deque(maxlen=num_recent)
        # (finished_at, bytes, seconds) of completed transfers, for the bandwidth plot
        self.history: deque[tuple[float, int, float]] = deque(maxlen=num_history)
        self.num_in_flight = 0
        self.num_transfers: Counter[str] = Counter()  # by status
        self.num_failures: Counter[str] = Counter()  # by reason
        self.num_migrations: Counter[str] = Counter()  # by cause
        self.num_bytes = 0
        self.duration_counts = [0] * (len(DURATION_BUCKETS_S) + 1)
        self.duration_sum_s = 0.0
        self.bandwidth_counts = [0] * (len(BANDWIDTH_BUCKETS_GBPS) + 1)
        self.bandwidth_sum_gbps = 0.0
        # (prefill worker, decode worker) -> the latest probed rate of its link
        self.link_gbps: dict[tuple[str, str], float] = {}
        self.link_fraction_counts = [0] * (len(LINK_FRACTION_BUCKETS) + 1)
        self.link_fraction_sum = 0.0
        # per prefill worker, over the prompts it prefilled: (tokens looked up, tokens hit)
        self.prefix_tokens: dict[str, list[int]] = {}

    def begin(
        self,
        request_id: str,
        prefill_worker: str,
        decode_worker: str,
        num_prompt_tokens: int,
        call: asyncio.Task[PrefillOutcome],
    ) -> TransferHandle:
        """A transfer starts: `call` is the prefill worker's call that reports its end."""
        self.num_in_flight += 1
        handle = TransferHandle(request_id, prefill_worker, decode_worker, num_prompt_tokens)
        traced = REQUEST_TRACE.get()
        if traced is not None:
            timing = AttemptTiming(
                request_id, prefill_worker, decode_worker, num_prompt_tokens, time.time_ns()
            )
            call.add_done_callback(lambda _: setattr(timing, "answer_ns", time.time_ns()))
            traced.attempts.append(timing)
            handle.timing = timing
        return handle

    def prefix_hit_rate(self, prefill_worker: str) -> float | None:
        """Prompt tokens the worker found in its prefix cache over those it was sent."""
        queries, hits = self.prefix_tokens.get(prefill_worker, (0, 0))
        return hits / queries if queries else None

    def end(
        self,
        handle: TransferHandle,
        call: asyncio.Task[PrefillOutcome],
        error: BaseException | None,
    ) -> TransferRecord:
        """Record how the transfer ended: from the prefill worker's answer when `call`
        finished, else from `error`, the exception ending the attempt (None: it succeeded)."""
        self.num_in_flight -= 1
        num_bytes, duration_s, reason, num_cached = 0, 0.0, "", 0
        num_chunks, link_gbps = 0, 0.0
        if call.done() and not call.cancelled() and call.exception() is None:
            outcome = call.result()
            num_chunks, link_gbps = outcome.num_transfer_chunks, outcome.link_gbps
            status = outcome.status.value
            num_bytes, duration_s = outcome.num_transfer_bytes, outcome.transfer_s
            num_cached = outcome.num_cached_tokens
            counts = self.prefix_tokens.setdefault(handle.prefill_worker, [0, 0])
            counts[0] += handle.num_prompt_tokens
            counts[1] += outcome.num_cached_tokens
            if outcome.status == TransferStatus.FAILED:
                reason = _failure_reason(outcome.error, outcome.retryable)
        elif call.done() and not call.cancelled():
            status = "failed"
            rpc_error = call.exception()
            reason = (
                rpc_error.code().name.lower()
                if isinstance(rpc_error, grpc.aio.AioRpcError)
                else "error"
            )
        elif error is not None and not isinstance(error, asyncio.CancelledError):
            status, reason = "failed", _attempt_reason(str(error))
        else:
            status = "cancelled"
        record = TransferRecord(
            handle.request_id, handle.prefill_worker, handle.decode_worker, status, reason,
            num_bytes, duration_s, time.time(), link_gbps,
        )  # fmt: skip
        self._count(record)
        timing = handle.timing
        if timing is not None:
            timing.end_ns = time.time_ns()
            timing.status, timing.reason = status, reason
            timing.num_bytes, timing.transfer_s = num_bytes, duration_s
            timing.num_chunks, timing.link_gbps = num_chunks, link_gbps
            timing.num_cached_tokens = num_cached
        return record

    def count_migration(self, cause: str) -> None:
        """A request moved to another attempt (another worker): `cause` from its error."""
        self.num_migrations[_attempt_reason(cause)] += 1

    def _count(self, record: TransferRecord) -> None:
        self.recent.append(record)
        self.num_transfers[record.status] += 1
        if record.link_gbps > 0:
            self.link_gbps[(record.prefill_worker, record.decode_worker)] = record.link_gbps
        if record.status == "failed":
            self.num_failures[record.reason] += 1
        if record.status != "done":
            return
        self.num_bytes += record.num_bytes
        self.history.append((record.finished_at, record.num_bytes, record.duration_s))
        self.duration_sum_s += record.duration_s
        self.duration_counts[_bucket(DURATION_BUCKETS_S, record.duration_s)] += 1
        if record.duration_s > 0:
            self.bandwidth_sum_gbps += record.gbps
            self.bandwidth_counts[_bucket(BANDWIDTH_BUCKETS_GBPS, record.gbps)] += 1
        fraction = record.link_fraction
        if fraction is not None:
            self.link_fraction_sum += fraction
            self.link_fraction_counts[_bucket(LINK_FRACTION_BUCKETS, fraction)] += 1


def _bucket(bounds: tuple[float, ...], value: float) -> int:
    for i, bound in enumerate(bounds):
        if value <= bound:
            return i
    return len(bounds)


def _failure_reason(error: str, retryable: bool) -> str:
    text = error.lower()
    if "timed out" in text or "timeout" in text:
        return "timeout"
    return "peer_lost" if retryable else "error"


def _attempt_reason(message: str) -> str:
    if "decode worker" in message:
        return "decode_lost"
    if "prefill worker" in message:
        return "prefill_lost"
    if "timed out" in message:
        return "timeout"
    return "other"
