"""One attempt of one sample on the cluster, as an explicit state machine:

    RESERVE --reserved--> PREFILL --first delta--> STREAM --finished--> DONE
    RESERVE --started (the decode worker prefills)--> STREAM
    any phase --failure--> RetryAttempt(reason), or the request's own error

- RESERVE: the decode worker is asked for a sequence slot and blocks for a prompt a prefill
  worker computes (`DecodeRemote`), or to prefill the prompt itself (`Generate`: conditional
  disaggregation, when the uncached part is short or no prefill worker is up). With
  `ClusterConfig.prefill_with_reservation` and the decode worker's KV address known from its
  load report, the prefill call starts beside the reservation (KV that lands first waits in
  the decode worker's inbox, kv_transfer/inbox.py); otherwise once the reservation answered.
- PREFILL: the KV is on its way; the decode stream is read. With prompt logprobs, which only
  the prefill worker's answer carries, the stream's deltas wait until that answer is in.
- STREAM: deltas fold into the sample until it finishes (a stop string the router finds ends
  it too).
- DONE: the sample finished. Its tokens can overtake the prefill worker's answer (what the
  transfer cost, for the metrics): that answer is waited for up to `PREFILL_ANSWER_GRACE_S`.

Events move the machine: the reservation's answer, the prefill worker's answer, each delta of
the decode stream and the stream's end, put on one queue by the tasks that wait for them. A
failure in any phase is classified by the one table in outcomes.py. However the attempt ends,
one clean-up cancels what still runs (which aborts the request on both workers), ends the
transfer's record and gives back the pool's accounting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Coroutine
from contextlib import ExitStack
from typing import Any

import grpc

from duet.cluster.attempt_events import (
    DeltaArrived,
    Event,
    Phase,
    PrefillAnswered,
    Reserved,
    ReserveFailed,
    Route,
    StreamEnded,
)
from duet.cluster.config import ClusterConfig
from duet.cluster.decode_client import DecodeStream
from duet.cluster.outcomes import FULL_BACKOFF_S, Failure, Outcome, Side
from duet.cluster.prefill_client import PrefillOutcome
from duet.cluster.sample import ClusterSample
from duet.cluster.transfer_log import TransferHandle, TransferLog
from duet.cluster.worker_pool import DecodeState, PrefillState, WorkerPool
from duet.engine import InvalidInputError
from duet.engine.async_engine import EngineDeadError
from duet.engine.llm_engine import EngineStats
from duet.kv_transfer import TransferStatus
from duet.v1 import worker_pb2
from duet.wire.sampling import sampling_to_proto

PREFILL_ANSWER_GRACE_S = 2.0
"""How long a finished sample waits for its prefill worker's answer before cancelling it."""
EVENT_SLACK_S = 5.0
"""How long past the request's deadline an attempt waits for its next event: every source has
a bound of its own (the calls' and the stream's deadlines); this one is the backstop."""


class RetryAttempt(Exception):
    """This attempt failed in a way another attempt may not; `outcome` says how (a worker
    without room is a reason to wait, not a failure)."""

    def __init__(self, message: str, outcome: Outcome = Outcome.RETRY) -> None:
        super().__init__(message)
        self.outcome = outcome


class AttemptRunner:
    """Runs attempts for `ClusterEngine` over its pool, its stats and its transfer log."""

    def __init__(
        self,
        config: ClusterConfig,
        pool: WorkerPool,
        stats: EngineStats,
        transfers: TransferLog,
    ) -> None:
        self.config = config
        self.pool = pool
        self.stats = stats
        self.transfers = transfers

    async def run(
        self,
        sample: ClusterSample,
        prompt_ids: list[int],
        decode: DecodeState,
        attempt: int,
        deadline: float,
        updates: asyncio.Queue[BaseException | None],
    ) -> None:
        """One attempt of `sample` on `decode` (and a prefill worker the pool picks), until
        the sample finished; `updates` hears of every change. Raises `RetryAttempt`, or the
        request's own error (`InvalidInputError`, `EngineDeadError`)."""
        request = sample.request
        ids = prompt_ids + request.output_token_ids  # after a lost decode worker: continue
        emitted = request.num_output_tokens
        # Stop strings are the router's (it sees all the text, across attempts).
        params = dataclasses.replace(
            request.sampling_params,
            max_tokens=request.max_tokens - emitted,
            min_tokens=max(0, request.sampling_params.min_tokens - emitted),
            stop=[],
            # A continuation's prompt logprobs were out before its first token.
            prompt_logprobs=None if emitted else request.sampling_params.prompt_logprobs,
        )
        if deadline - time.monotonic() <= 0:
            raise EngineDeadError(f"request timed out after {self.config.request_timeout_s}s")
        pick = self.pool.pick_prefill(ids, salt=params.cache_salt)
        uncached = len(ids) - (pick[1] if pick else 0)
        if attempt == 1:
            self.stats.prefix_cache_queries += len(ids)
        wants_prompt_logprobs = params.prompt_logprobs is not None
        if wants_prompt_logprobs and pick is None:
            # NOTE: the decode workers' outputs do not carry prompt logprobs; only a
            # prefill worker's answer does.
            raise EngineDeadError("prompt_logprobs: no prefill worker is available; retry later")
        # An embedding request runs whole on the decode worker: the vector comes back with
        # its outputs (a prefill worker's answer has none).
        local = (
            pick is None
            or params.pooling is not None
            or (uncached <= self.config.local_prefill_threshold and not wants_prompt_logprobs)
        )
        route = Route(decode, None if local or pick is None else pick[0], uncached)
        transfer_id = f"{request.request_id}@{attempt}"
        wire = sampling_to_proto(params)  # InvalidInputError here: the request's, no retry
        await Attempt(self, sample, route, transfer_id, ids, wire, deadline, updates).run()

    def settle(self, failure: Failure, worker: PrefillState | DecodeState) -> Exception:
        """What ends the attempt for `failure` on `worker`, once its outcome's mark on the
        pool is made."""
        outcome = failure.outcome
        if outcome is Outcome.INVALID_INPUT:
            refused = f"refused by the {failure.side.value}"
            return InvalidInputError("prompt", failure.details or refused)
        if outcome is Outcome.TIMED_OUT:
            return EngineDeadError(f"request timed out after {self.config.request_timeout_s}s")
        if outcome is Outcome.WORKER_LOST:
            self.pool.mark_broken(worker, failure.message)
        elif outcome is Outcome.WORKER_FULL and isinstance(worker, DecodeState):
            worker.full_until = time.monotonic() + FULL_BACKOFF_S
        return RetryAttempt(failure.message, outcome)


class Attempt:
    """One attempt's state machine (see the module's docstring). `run` once."""

    def __init__(
        self,
        runner: AttemptRunner,
        sample: ClusterSample,
        route: Route,
        transfer_id: str,
        prompt_ids: list[int],
        params: worker_pb2.SamplingParams,
        deadline: float,
        updates: asyncio.Queue[BaseException | None],
    ) -> None:
        self.runner = runner
        self.sample = sample
        self.route = route
        self.transfer_id = transfer_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.deadline = deadline
        self.updates = updates
        self.num_replayed = sample.request.num_output_tokens  # a grammar replays them
        self.priority = sample.request.priority
        self.phase = Phase.RESERVE
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []  # the reservation's and the stream reader
        self._stream: DecodeStream | None = None
        self._prefill_call: asyncio.Task[PrefillOutcome] | None = None
        self._kv_address = ""  # where the prefill call sends the KV
        self._transfer: TransferHandle | None = None
        self._accounting = ExitStack()
        self._held: list[worker_pb2.OutputDelta] | None = (
            [] if params.HasField("prompt_logprobs") else None
        )
        """Deltas waiting for the prompt logprobs (None: nothing waits for them)."""

    async def run(self) -> None:
        error: BaseException | None = None
        try:
            self._reserve()
            while self.phase is not Phase.DONE:
                self._on(await self._next_event())
        except BaseException as e:
            error = e
            raise
        finally:
            await self._end(error)

    # -- transitions -----------------------------------------------------------------------

    def _on(self, event: Event) -> None:
        match event:
            case Reserved(stream):
                self._reserved(stream)
            case ReserveFailed(error):
                raise self._decode_failure(error)
            case PrefillAnswered():
                self._prefill_answered()
            case DeltaArrived(delta):
                self._delta(delta)
            case StreamEnded(error):
                raise self._stream_failure(error)

    def _reserve(self) -> None:
        route, config, pool = self.route, self.runner.config, self.runner.pool
        decode = route.decode
        timeout_s = self.deadline - time.monotonic()
        num_blocks = -(-len(self.prompt_ids) // max(1, decode.block_size))
        # NOTE: the prefill starts beside the reservation only where the decode worker's last
        # report shows room: a refused reservation would waste the prefill and leave its KV in
        # the decode worker's inbox until it goes stale.
        beside = (
            config.prefill_with_reservation
            and bool(decode.kv_address)
            and decode.has_room(num_blocks, time.monotonic())
        )
        self._accounting.enter_context(pool.sending_to_decode(decode, num_blocks))
        call: Coroutine[Any, Any, DecodeStream]
        if route.prefill is None:
            call = decode.client.generate(
                self.transfer_id, self.prompt_ids, self.params, timeout_s, self.num_replayed,
                self.priority,
            )  # fmt: skip
        else:
            call = decode.client.reserve(
                self.transfer_id, self.prompt_ids, self.params, config.kv_wait_s, timeout_s,
                self.num_replayed, self.priority,
            )  # fmt: skip
            if beside:
                self._prefill(decode.kv_address)
        self._spawn(self._await_reservation(call))

    def _reserved(self, stream: DecodeStream) -> None:
        self._stream = stream
        self._spawn(self._read(stream))
        if self.route.prefill is None:
            self.phase = Phase.STREAM
            return
        self.phase = Phase.PREFILL
        kv_address = stream.reserved.kv_address if stream.reserved else ""
        if self._prefill_call is None:
            self._prefill(kv_address)
        elif kv_address != self._kv_address:  # it restarted since its report: the KV is lost
            decode = self.route.decode
            raise self.runner.settle(Failure.kv_address_moved(decode.name, kv_address), decode)

    def _prefill(self, kv_address: str) -> None:
        route, runner = self.route, self.runner
        prefill = route.prefill
        assert prefill is not None
        self._accounting.enter_context(runner.pool.sending_to_prefill(prefill, route.num_uncached))
        timeout_s = min(self.deadline - time.monotonic(), runner.config.kv_wait_s)
        call = asyncio.create_task(
            prefill.client.prefill(
                self.transfer_id, self.prompt_ids, self.params, kv_address, timeout_s,
                self.num_replayed, self.priority,
            )
        )  # fmt: skip
        call.add_done_callback(lambda _: self._events.put_nowait(PrefillAnswered()))
        self._prefill_call, self._kv_address = call, kv_address
        self._transfer = runner.transfers.begin(
            self.transfer_id, prefill.name, route.decode.name, len(self.prompt_ids), call
        )

    def _prefill_answered(self) -> None:
        call, prefill = self._prefill_call, self.route.prefill
        assert call is not None and prefill is not None
        if call.cancelled():
            return  # by `_end` only, whose events nobody reads
        failure = self._prefill_failure()
        if failure is not None:
            raise self.runner.settle(failure, prefill)
        if self._held is None:
            return
        entries = call.result().prompt_logprobs
        if entries is None:
            raise self.runner.settle(Failure.no_prompt_logprobs(prefill.name), prefill)
        self.sample.assembler.set_prompt_logprobs(entries)
        held, self._held = self._held, None
        for delta in held:
            self._delta(delta)
            if self.phase is Phase.DONE:  # a stop string: what came after it is not output
                break

    def _delta(self, delta: worker_pb2.OutputDelta) -> None:
        if self._held is not None:
            self._held.append(delta)
            return
        if self.sample.apply(delta, self.runner.stats):
            self.updates.put_nowait(None)
        self.phase = Phase.DONE if self.sample.finish_reason is not None else Phase.STREAM

    def _decode_failure(self, error: Exception) -> Exception:
        if not isinstance(error, grpc.aio.AioRpcError):
            return error  # not the worker's answer: the request's own error
        decode = self.route.decode
        return self.runner.settle(Failure.of_rpc(Side.DECODE, decode.name, error), decode)

    def _stream_failure(self, error: Exception | None) -> Exception:
        decode, prefill = self.route.decode, self.route.prefill
        if error is None:
            return self.runner.settle(Failure.stream_ended(decode.name), decode)
        if (
            isinstance(error, grpc.aio.AioRpcError)
            and prefill is not None
            and self._prefill_call is not None
            and self._prefill_call.done()
        ):
            # The decode side gave up waiting because the prefill side failed: its cause.
            failure = self._prefill_failure()
            if failure is not None:
                return self.runner.settle(failure, prefill)
        return self._decode_failure(error)

    def _prefill_failure(self) -> Failure | None:
        """Why the finished prefill call means the KV will not come; None if it came."""
        call, prefill = self._prefill_call, self.route.prefill
        assert call is not None and prefill is not None
        if call.cancelled():
            return None
        error = call.exception()
        if error is not None:
            return Failure.of_error(Side.PREFILL, prefill.name, error)
        outcome = call.result()
        if outcome.status == TransferStatus.DONE:
            return None
        return Failure.of_transfer(prefill.name, outcome.status, outcome.error)

    # -- event sources -----------------------------------------------------------------------

    def _spawn(self, source: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.create_task(source))

    async def _await_reservation(self, call: Coroutine[Any, Any, DecodeStream]) -> None:
        try:
            stream = await call
        except Exception as e:
            self._events.put_nowait(ReserveFailed(e))
            return
        self._events.put_nowait(Reserved(stream))

    async def _read(self, stream: DecodeStream) -> None:
        finished = False
        try:
            async for delta in stream.deltas():
                finished = bool(delta.finish_reason)
                self._events.put_nowait(DeltaArrived(delta))
        except Exception as e:
            self._events.put_nowait(StreamEnded(e))
            return
        if not finished:
            self._events.put_nowait(StreamEnded(None))

    async def _next_event(self) -> Event:
        wait_s = self.deadline - time.monotonic() + EVENT_SLACK_S
        try:
            return await asyncio.wait_for(self._events.get(), max(0.0, wait_s))
        except TimeoutError:
            timeout_s = self.runner.config.request_timeout_s
            raise EngineDeadError(f"request timed out after {timeout_s}s") from None

    # -- the one clean-up --------------------------------------------------------------------

    async def _end(self, error: BaseException | None) -> None:
        """Stop what still runs, abort what the workers still run, end the transfer's record
        and give back the accounting; `error` is what ends the attempt (None: it finished)."""
        call = self._prefill_call
        try:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._stream is not None:
                self._stream.cancel()  # aborts the request there unless its stream is over
            while not self._events.empty():  # a reservation nobody read: abort it too
                event = self._events.get_nowait()
                if isinstance(event, Reserved):
                    event.stream.cancel()
            if call is not None and not call.done() and error is None:
                # The sample finished, so its KV arrived: the prefill worker's answer (what the
                # transfer cost, for the metrics) is due; tokens can overtake it.
                await asyncio.wait({call}, timeout=PREFILL_ANSWER_GRACE_S)
        finally:  # even when cancelled meanwhile: every begin has its end
            if call is not None:
                if not call.done():
                    call.cancel()
                call.add_done_callback(_retrieve)
                assert self._transfer is not None
                self.runner.transfers.end(self._transfer, call, error)
            self._accounting.close()


def _retrieve(call: asyncio.Task[PrefillOutcome]) -> None:
    """A prefill call's error is the transfer's record (or the attempt's), not a warning
    that a task's exception was never retrieved."""
    if not call.cancelled():
        call.exception()
