"""The workers' spans of a traced request, children of the router's `duet.request` span
(telemetry/otel.py carries its context in the call's metadata).

Prefill worker, one `Prefill` call: `duet.prefill_worker` (call received to answered), with
`.queue` (received to the first step that computed the prompt), `.compute` (to the prefill's
end) and `.kv_send` (to the decode side's acknowledgement, with the transfer's attributes,
telemetry/transfer_attributes.py). Decode worker, one `DecodeRemote` or `Generate`:
`duet.decode_worker` (call received to the request's end), with `.kv_wait` (to the first
output, which comes with the KV; `.prefill` for `Generate`, which prefills there) and `.decode`
(first output to last). Times are the worker's wall clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import Protocol

from opentelemetry import trace
from opentelemetry.context import Context

from duet.kv_transfer import TransferStatus
from duet.telemetry.transfer_attributes import kv_transfer_attributes
from duet.v1 import worker_pb2


class PrefillAnswer(Protocol):
    """What `record_prefill` reads of a prefill worker's `PrefillResult`."""

    @property
    def request_id(self) -> str: ...
    @property
    def status(self) -> TransferStatus: ...
    @property
    def error(self) -> str | None: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def num_transfer_bytes(self) -> int: ...
    @property
    def transfer_s(self) -> float: ...
    @property
    def queued_s(self) -> float: ...
    @property
    def num_transfer_chunks(self) -> int: ...
    @property
    def link_gbps(self) -> float: ...
    @property
    def acked_ns(self) -> int: ...


def record_prefill(
    tracer: trace.Tracer,
    parent: Context,
    worker: str,
    received_ns: int,
    result: PrefillAnswer,
) -> None:
    """Emit one `Prefill` call's spans, ending now."""
    end_ns = time.time_ns()
    attrs = {"duet.request_id": result.request_id, "duet.worker": worker}
    root = tracer.start_span(
        "duet.prefill_worker", context=parent, start_time=received_ns, attributes={
            **attrs, "duet.cached_tokens": result.num_cached_tokens,
            "duet.kv_transfer.status": result.status.value,
        }, kind=trace.SpanKind.SERVER,
    )  # fmt: skip
    if result.error:
        root.set_status(trace.StatusCode.ERROR, result.error)
    inside = trace.set_span_in_context(root)
    # The phases end where the worker measured them: the send at the acknowledgement (its wall
    # clock then; `end_ns`, later by the answer's way back to this handler, where absent),
    # the compute `transfer_s` before it. Anchored at `end_ns`, that way back counted as
    # compute, and a loaded worker's compute ended after the decode side had its KV.
    acked_ns = min(end_ns, result.acked_ns or end_ns)
    sent_ns = max(received_ns, acked_ns - int(result.transfer_s * 1e9))
    computed_ns = min(sent_ns, received_ns + int(result.queued_s * 1e9))
    for name, start, end, extra in (
        ("duet.prefill_worker.queue", received_ns, computed_ns, {}),
        ("duet.prefill_worker.compute", computed_ns, sent_ns, {}),
        ("duet.prefill_worker.kv_send", sent_ns, acked_ns,
         kv_transfer_attributes(result.num_transfer_bytes, result.transfer_s,
                                result.num_transfer_chunks, result.link_gbps)),
    ):  # fmt: skip
        tracer.start_span(
            name, context=inside, start_time=start, attributes={**attrs, **extra}
        ).end(end_time=end)
    root.end(end_time=end_ns)


class TracedOutputs:
    """A decode worker request's outputs, passed through unchanged, recording its spans when
    it ends (or is closed). `first_phase`: `kv_wait` (DecodeRemote) or `prefill` (Generate)."""

    def __init__(
        self,
        outputs: AsyncIterable[worker_pb2.OutputDelta],
        tracer: trace.Tracer,
        parent: Context,
        worker: str,
        request_id: str,
        first_phase: str,
        received_ns: int,
    ) -> None:
        self._outputs = outputs
        self._it: AsyncIterator[worker_pb2.OutputDelta] | None = None
        self._tracer = tracer
        self._parent = parent
        self._attrs = {"duet.request_id": request_id, "duet.worker": worker}
        self._first_phase = first_phase
        self._received_ns = received_ns
        self._first_ns: int | None = None
        self._last_ns: int | None = None
        self._num_tokens = 0
        self._finish_reason = ""
        self._error: BaseException | None = None
        self._ended = False

    def __aiter__(self) -> TracedOutputs:
        return self

    async def __anext__(self) -> worker_pb2.OutputDelta:
        if self._it is None:
            self._it = aiter(self._outputs)
        try:
            out = await anext(self._it)
        except StopAsyncIteration:
            self._end()
            raise
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):  # cancelled: aborted, not failed
                self._error = e
            self._end()
            raise
        now = time.time_ns()
        if self._first_ns is None:
            self._first_ns = now
        self._last_ns = now
        self._num_tokens += len(out.token_ids)
        self._finish_reason = out.finish_reason or self._finish_reason
        return out

    async def aclose(self) -> None:
        try:
            await self._outputs.aclose()  # type: ignore[attr-defined]
        finally:
            self._end()

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        end_ns = time.time_ns()
        root = self._tracer.start_span(
            "duet.decode_worker", context=self._parent, start_time=self._received_ns,
            attributes={**self._attrs, "duet.generated_tokens": self._num_tokens,
                        "duet.finish_reason": self._finish_reason or "abort"},
            kind=trace.SpanKind.SERVER,
        )  # fmt: skip
        if self._error is not None:
            root.set_status(trace.StatusCode.ERROR, str(self._error) or type(self._error).__name__)
        inside = trace.set_span_in_context(root)
        first_ns = self._first_ns if self._first_ns is not None else end_ns
        self._tracer.start_span(
            f"duet.decode_worker.{self._first_phase}", context=inside,
            start_time=self._received_ns, attributes=self._attrs,
        ).end(end_time=first_ns)  # fmt: skip
        if self._first_ns is not None:
            self._tracer.start_span(
                "duet.decode_worker.decode", context=inside, start_time=first_ns,
                attributes={**self._attrs, "duet.generated_tokens": self._num_tokens},
            ).end(end_time=self._last_ns or end_ns)  # fmt: skip
        root.end(end_time=end_ns)
