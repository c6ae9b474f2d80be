"""One attempt of one sample on the cluster: a decode worker, and a prefill group unless the
decode worker prefills it itself; its tokens streamed into the sample. What makes an attempt
fail in a way another may not raises `RetryAttempt` (engine.py tries again)."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from dataclasses import dataclass

import grpc

from duet.cluster.config import ClusterConfig
from duet.cluster.decode_client import DecodeStream
from duet.cluster.prefill_client import PrefillOutcome
from duet.cluster.transfer_log import TransferLog
from duet.cluster.worker_pool import DecodeState, PrefillState, WorkerPool
from duet.engine import InvalidInputError
from duet.engine.async_engine import EngineDeadError
from duet.engine.llm_engine import EngineStats
from duet.engine.output_processor import OutputAssembler
from duet.engine.outputs import SampleDelta, TokenLogprob
from duet.engine.request import Request
from duet.kv_transfer import TransferStatus
from duet.v1 import worker_pb2

PREFILL_ANSWER_GRACE_S = 2.0
"""How long a finished sample waits for its prefill worker's answer before cancelling it."""


def _retrieve(call: asyncio.Task[PrefillOutcome]) -> None:
    """A prefill call's error is the transfer's record (or the attempt's), not a warning
    that a task's exception was never retrieved."""
    if not call.cancelled():
        call.exception()


class RetryAttempt(Exception):
    """This attempt failed in a way another attempt may not."""


@dataclass
class ClusterSample:
    """One of a request's `n` samples as the router runs it: the engine `Request` that holds
    its budget and the tokens streamed so far (a lost decode worker's successor continues
    from them), and the request's `OutputAssembler`, which makes the text."""

    index: int
    request: Request
    assembler: OutputAssembler

    @property
    def finish_reason(self) -> str | None:
        return self.assembler.samples[self.index].finish_reason


class AttemptRunner:
    """Runs attempts for `ClusterEngine` over its pool, its output processor and its stats."""

    def __init__(
        self,
        config: ClusterConfig,
        pool: WorkerPool,
        stats: EngineStats,
        transfers: TransferLog,
    ) -> None:
        self.config = config
        self.pool = pool
        self._stats = stats
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
        """The sample's assembler takes the prompt logprobs (computed by the prefill worker,
        with its answer) when the sample asked for them."""
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
        prompt_state = sample.assembler if params.prompt_logprobs is not None else None
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            raise EngineDeadError(f"request timed out after {self.config.request_timeout_s}s")
        transfer_id = f"{request.request_id}@{attempt}"
        pick = self.pool.pick_prefill(ids)
        uncached = len(ids) - (pick[1] if pick else 0)
        if attempt == 1:
            self._stats.prefix_cache_queries += len(ids)
        if prompt_state is not None and pick is None:
            # NOTE: the decode workers' outputs do not carry prompt logprobs; only a
            # prefill worker's answer does.
            raise EngineDeadError("prompt_logprobs: no prefill worker is available; retry later")
        if pick is None or (
            uncached <= self.config.local_prefill_threshold and prompt_state is None
        ):
            try:
                stream = await decode.client.generate(
                    transfer_id, ids, params, timeout, emitted, request.priority
                )
            except grpc.aio.AioRpcError as e:
                raise self._decode_failure(decode, e) from None
            await self._consume(sample, stream, decode, None, updates)
            return
        prefill = pick[0]
        num_blocks = -(-len(ids) // max(1, decode.block_size))
        decode.num_sent += 1
        decode.num_sent_blocks += num_blocks
        try:
            stream = await decode.client.reserve(
                transfer_id, ids, params, self.config.kv_wait_s, timeout, emitted, request.priority
            )
        except grpc.aio.AioRpcError as e:
            raise self._decode_failure(decode, e) from None
        prefill.num_sent_tokens += uncached
        prefill_call = asyncio.create_task(
            prefill.client.prefill(
                transfer_id,
                ids,
                params,
                stream.reserved.kv_address if stream.reserved else "",
                min(timeout, self.config.kv_wait_s),
                emitted,  # a grammar replays the output so far (worker.proto)
                request.priority,
            )
        )
        transfer = self.transfers.begin(
            transfer_id, prefill.name, decode.name, len(ids), prefill_call
        )
        try:
            await self._consume(
                sample, stream, decode, (prefill, prefill_call), updates, prompt_state
            )
        finally:
            prefill.num_sent_tokens = max(0, prefill.num_sent_tokens - uncached)
            error = sys.exc_info()[1]
            try:
                if not prefill_call.done() and error is None:
                    # The sample finished, so its KV arrived: the prefill worker's answer (what
                    # the transfer cost, for the metrics) is due; tokens can overtake it.
                    await asyncio.wait({prefill_call}, timeout=PREFILL_ANSWER_GRACE_S)
            finally:  # even when this attempt is cancelled meanwhile: every begin has its end
                if not prefill_call.done():
                    prefill_call.cancel()
                prefill_call.add_done_callback(_retrieve)
                self.transfers.end(transfer, prefill_call, error)

    async def _consume(
        self,
        sample: ClusterSample,
        stream: DecodeStream,
        decode: DecodeState,
        prefill: tuple[PrefillState, asyncio.Task[PrefillOutcome]] | None,
        updates: asyncio.Queue[BaseException | None],
        prompt_state: OutputAssembler | None = None,
    ) -> None:
        """Stream the attempt's tokens into the sample until it finishes. A prefill that
        fails first cancels the stream (the KV will never come). With `prompt_state`, the
        prefill worker's answer (which carries the prompt logprobs) comes first: no output
        of the request goes out without them (the tokens wait in the stream meanwhile)."""
        if prefill is not None and prompt_state is not None:
            await asyncio.wait({prefill[1]})  # bounded by the call's deadline
            problem = self._prefill_problem(*prefill)
            if problem is not None or prefill[1].cancelled():
                stream.cancel()
                raise RetryAttempt(problem or "prefill call cancelled")
            entries = prefill[1].result().prompt_logprobs
            if entries is None:
                stream.cancel()
                raise RetryAttempt(f"prefill worker {prefill[0].name} sent no prompt logprobs")
            prompt_state.set_prompt_logprobs(entries)
        reader = asyncio.create_task(self._read(sample, stream, updates))
        try:
            if prefill is not None:
                state, call = prefill
                done, _ = await asyncio.wait({reader, call}, return_when=asyncio.FIRST_COMPLETED)
                if call in done and not reader.done():
                    problem = self._prefill_problem(state, call)
                    if problem is not None:
                        raise RetryAttempt(problem)
            try:
                finished = await reader
            except grpc.aio.AioRpcError as e:
                if prefill is not None and prefill[1].done():
                    problem = self._prefill_problem(*prefill)
                    if problem is not None:
                        raise RetryAttempt(problem) from None
                raise self._decode_failure(decode, e) from None
            if not finished:
                self.pool.mark_broken(decode, RuntimeError("stream ended early"))
                raise RetryAttempt(f"decode worker {decode.name} ended the stream early")
        finally:
            if not reader.done():
                reader.cancel()
                stream.cancel()
                await asyncio.gather(reader, return_exceptions=True)

    async def _read(
        self,
        sample: ClusterSample,
        stream: DecodeStream,
        updates: asyncio.Queue[BaseException | None],
    ) -> bool:
        """True once the sample finished (the stream is then cancelled if still open)."""
        async for delta in stream.deltas():
            if self._apply(sample, delta):
                updates.put_nowait(None)
            if sample.finish_reason is not None:
                stream.cancel()
                return True
        return False

    def _apply(self, sample: ClusterSample, delta: worker_pb2.OutputDelta) -> bool:
        """Fold a worker's delta into the sample; True when anything changed."""
        request = sample.request
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = delta.num_cached_tokens
            self._stats.prefix_cache_hits += delta.num_cached_tokens
        if not delta.token_ids and not delta.finish_reason:
            return False
        stop_token = None
        if delta.finish_reason and delta.WhichOneof("stop_reason") == "stop_token_id":
            request.stop_reason = stop_token = delta.stop_token_id
        logprobs: list[TokenLogprob | None] = [
            (lp.sampled.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in delta.logprobs
        ]
        tokens = sample.assembler.samples[sample.index].token_ids
        before = len(tokens)
        finish = delta.finish_reason or None
        ids = list(delta.token_ids)
        sample.assembler.add_sample(SampleDelta(sample.index, ids, logprobs, finish, stop_token))
        for token in tokens[before:]:  # up to a stop string's last token
            request.append_output_token(token)
        self._stats.num_generated_tokens += len(tokens) - before
        return True

    def _prefill_problem(
        self, state: PrefillState, call: asyncio.Task[PrefillOutcome]
    ) -> str | None:
        """Why a finished prefill call means the KV will not come; None if it came."""
        if call.cancelled():
            return None
        error = call.exception()
        if isinstance(error, grpc.aio.AioRpcError):
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidInputError("prompt", error.details() or "refused") from None
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                self.pool.mark_broken(state, error)
            return f"prefill worker {state.name}: {error.code().name}: {error.details()}"
        if error is not None:
            return f"prefill worker {state.name}: {error!r}"
        outcome = call.result()
        if outcome.status == TransferStatus.DONE:
            return None
        return f"prefill worker {state.name}: KV transfer {outcome.status.value}: {outcome.error}"

    def _decode_failure(self, decode: DecodeState, error: grpc.aio.AioRpcError) -> Exception:
        code = error.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidInputError("prompt", error.details() or "refused by the decode worker")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            decode.full_until = time.monotonic() + 0.2
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return EngineDeadError(f"request timed out after {self.config.request_timeout_s}s")
        elif code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            self.pool.mark_broken(decode, error)
        return RetryAttempt(f"decode worker {decode.name}: {code.name}: {error.details()}")
