"""`ClusterEngine`: the router's `EngineClient` in disaggregated mode.

A request's samples (`n` of them, seeds `seed + i` as in the engine) each run as an attempt:
pick a decode worker; if the prompt's uncached part is short (`local_prefill_threshold`) or no
prefill worker is up, the decode worker prefills it itself (conditional disaggregation);
otherwise reserve blocks on the decode worker while the chosen prefill worker computes the KV
and ships it there, and stream the tokens back from the decode worker (attempt.py).

The router detokenizes: workers send token ids (and logprobs); the engine's own
`OutputAssembler` turns them into text, applies stop strings (then cancels the worker's
stream) and builds the `RequestOutput`s, so outputs read exactly as in aggregated mode.

Failures never lose an accepted request silently. A prefill worker that fails or dies, or a
KV transfer that fails, sends the attempt elsewhere. A decode worker without room is no
failure: the request waits for room (on any decode worker, backing off up to `ROOM_WAIT_MAX_S`
between tries), bounded only by its own timeout, and spends none of its attempts meanwhile. A decode
worker that dies mid-stream is replaced: the new attempt prefills prompt + the tokens already
streamed, and continues with the remaining budget (greedy output is unchanged; a seeded sample
continues with a fresh draw sequence, and presence/frequency penalties count the streamed
tokens as prompt). When no decode worker is left, an accepted request that lost its worker waits
for one to join (the only worker, or a data-parallel group, restarting), bounded by its timeout,
and a new one ends at once. After `max_attempts` failures, past the request's timeout, or with no
decode worker for a new request, the request ends with `EngineDeadError` (503 / UNAVAILABLE:
retryable).

Timeouts nest: request (`request_timeout_s`) > decode worker's wait for KV (`kv_wait_s`) >
prefill worker's lease on sent blocks > one transfer's network operations.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator

from duet.cluster.attempt import AttemptRunner, RetryAttempt
from duet.cluster.config import ClusterConfig
from duet.cluster.outcomes import Outcome
from duet.cluster.sample import ClusterSample
from duet.cluster.transfer_log import TransferLog
from duet.cluster.worker_pool import ClusterStats, WorkerPool
from duet.engine import RequestOutput, SamplingParams
from duet.engine.async_engine import EngineDeadError
from duet.engine.llm_engine import EngineStats, Prompt, check_lengths, check_vocab, tokenize_prompt
from duet.engine.loader import open_model
from duet.engine.output_processor import OutputAssembler
from duet.engine.request import Request
from duet.engine.tokenizer import Message, Tokenizer

__all__ = ["ClusterEngine"]

logger = logging.getLogger(__name__)

ROOM_WAIT_MIN_S = 0.05
"""The first wait of a request that found no room on a decode worker; it doubles per try."""
ROOM_WAIT_MAX_S = 1.0
"""The longest wait between tries for room: how late a waiting request may notice freed
blocks. Each try costs the decode worker one refused call."""


class ClusterEngine:
    def __init__(
        self,
        model: str | None,
        config: ClusterConfig | None = None,
        tokenizer: str | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.config = config or ClusterConfig()
        source = open_model(model, tokenizer)
        self._tokenizer = source.tokenizer
        self._vocab_size = source.arch.vocab_size
        self._declared_pooling = source.arch.declared_pooling
        self._model_name = source.name
        limit = source.arch.max_position_embeddings
        self._max_model_len = min(max_model_len or limit, limit)
        self.pool = WorkerPool(self.config.poll_interval_s)
        self._ids = itertools.count()
        self._instance = uuid.uuid4().hex[:12]  # unique per router: ids never collide
        self._stopped = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._stats = EngineStats()
        self.transfers = TransferLog()  # /metrics and the dashboard read it
        self._attempt = AttemptRunner(self.config, self.pool, self._stats, self.transfers)

    # -- EngineClient ----------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def max_num_seqs(self) -> int:
        """Sequences the healthy decode workers run at once (from their load reports); the
        configured estimate until the first reports."""
        reported = sum(d.max_num_seqs for d in self.pool.healthy_decode())
        if reported:
            return reported
        return self.config.max_num_seqs_per_decode_worker * max(1, self.config.num_decode_workers)

    @property
    def is_running(self) -> bool:
        return not self._stopped

    @property
    def is_ready(self) -> bool:
        return not self._stopped and bool(self.pool.healthy_decode())

    @property
    def scheduling_policy(self) -> str:
        """The workers' policy (`ClusterConfig.scheduling_policy`)."""
        return self.config.scheduling_policy

    @property
    def speculates_with_ngram(self) -> bool:
        """True when every healthy decode worker reports it speculates with ngram (and there
        is one): then a request's Predicted Outputs travel to whichever decodes it; else its
        `prediction` is named ignored."""
        decode = self.pool.healthy_decode()
        return bool(decode) and all(w.ngram for w in decode)

    @property
    def declared_pooling(self) -> str | None:
        return self._declared_pooling

    @property
    def computes_embeddings(self) -> bool:
        """An embedding request runs whole on a decode worker (no prefill worker, no KV
        transfer), whose last output carries the vector."""
        return True

    @property
    def deterministic(self) -> bool:
        """True when every healthy worker reports it (and there is one of each kind)."""
        prefill, decode = self.pool.healthy_prefill(), self.pool.healthy_decode()
        return (
            bool(prefill and decode)
            and all(w.deterministic for w in prefill)
            and all(w.deterministic for w in decode)
        )

    @property
    def stats(self) -> EngineStats:
        c = self.pool.stats()
        s = self._stats
        s.num_running = c.decode_running
        s.num_waiting = c.decode_waiting
        s.kv_usage = 1.0 - c.decode_free_blocks / c.decode_blocks if c.decode_blocks else 0.0
        return s

    @property
    def cluster_stats(self) -> ClusterStats:
        return self.pool.stats()

    def tokenize_prompt(self, prompt: Prompt, bounded: bool = True) -> tuple[str | None, list[int]]:
        bound = self._max_model_len if bounded else None
        return tokenize_prompt(self._tokenizer, self._vocab_size, prompt, bound)

    def encode_chat(self, messages: list[Message]) -> list[int]:
        return self._tokenizer.encode_chat(messages)

    def check_lengths(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        pools = [s.num_blocks * s.block_size for s in self.pool.healthy_decode() if s.num_blocks]
        capacity = min(pools) if pools else self._max_model_len
        check_vocab(params, self._vocab_size)
        return check_lengths(num_prompt_tokens, params, self._max_model_len, capacity)

    async def start(self) -> None:
        await self.pool.start()

    async def stop(self) -> None:
        self.shutdown()
        await self.pool.stop()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """New requests are refused; in-flight ones end with `EngineDeadError`."""
        self._stopped = True
        for task in list(self._tasks):
            task.cancel()

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        if self._stopped:
            raise EngineDeadError("the router is shutting down")
        params = params or SamplingParams()
        text, ids = self.tokenize_prompt(prompt)
        max_tokens = self.check_lengths(len(ids), params)
        # NOTE: workers see an id this router makes, never the client's: a client cannot pick
        # an id another request (of another tenant, or another router) uses on the workers.
        internal_id = f"{self._instance}-{next(self._ids)}"
        request_id = request_id or internal_id
        assembler = OutputAssembler(self._tokenizer, request_id, text, ids, params)
        samples: list[ClusterSample] = []
        for index in range(params.n):
            sample_params = params
            if params.n > 1:  # one sample computes the prompt logprobs for all
                seed = None if params.seed is None else params.seed + index
                prompt_logprobs = params.prompt_logprobs if index == 0 else None
                sample_params = dataclasses.replace(
                    params, n=1, seed=seed, prompt_logprobs=prompt_logprobs
                )
            sub_id = internal_id if params.n == 1 else f"{internal_id}#{index}"
            eos = self._tokenizer.eos_token_ids
            request = Request(sub_id, ids, sample_params, max_tokens, eos, priority)
            samples.append(ClusterSample(index, request, assembler))
        self._stats.num_prompt_tokens += len(ids) * params.n
        updates: asyncio.Queue[BaseException | None] = asyncio.Queue()
        tasks = [
            asyncio.create_task(
                self._run_sample(sample, ids, updates), name=sample.request.request_id
            )
            for sample in samples
        ]
        self._tasks.update(tasks)
        for task in tasks:
            task.add_done_callback(self._tasks.discard)
        finished = False
        try:
            while True:
                items = [await updates.get()]
                while not updates.empty():
                    items.append(updates.get_nowait())
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                if params.prompt_logprobs is not None and assembler.prompt_logprobs is None:
                    continue  # sample 0's prefill answer brings them; nothing goes out before
                assembler.num_cached_tokens = max(0, samples[0].request.num_cached_tokens)
                out = assembler.output()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            # NOTE: a finished request's attempts may still wait (bounded by
            # PREFILL_ANSWER_GRACE_S, and only when tokens overtook it) for their prefill
            # worker's answer, which the transfer's metrics and trace record: they end on
            # their own. A request the client left, or that failed, has its attempts cancelled.
            if not finished:
                for task in tasks:
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- one sample ------------------------------------------------------------------------------

    async def _run_sample(
        self,
        sample: ClusterSample,
        prompt_ids: list[int],
        updates: asyncio.Queue[BaseException | None],
    ) -> None:
        try:
            await self._attempts(sample, prompt_ids, updates)
        except asyncio.CancelledError:
            if self._stopped:
                updates.put_nowait(EngineDeadError("the router shut down"))
            raise
        except BaseException as e:
            updates.put_nowait(e)

    async def _attempts(
        self,
        sample: ClusterSample,
        prompt_ids: list[int],
        updates: asyncio.Queue[BaseException | None],
    ) -> None:
        request = sample.request
        deadline = time.monotonic() + self.config.request_timeout_s
        last_error = "no attempt was made"
        num_failed = num_waits = 0
        failed_on: list[str] = []
        awaiting_worker = False
        # `tries` names each attempt's transfer uniquely; only failures count toward
        # `max_attempts`, never a wait for room.
        for tries in itertools.count(1):
            # NOTE: a retry goes to a decode worker that has not failed this request where
            # there is one: a worker the pool still counts healthy may be cut off from the
            # prefill workers (a network partition fails every KV transfer to it).
            num_tokens = len(prompt_ids) + request.num_output_tokens
            decode = self.pool.pick_decode(num_tokens, exclude=failed_on) or self.pool.pick_decode(
                num_tokens
            )
            if decode is None:
                if num_failed == 0 and num_waits == 0:  # a new request: 503 at once, retryable
                    raise EngineDeadError("no decode worker is available; retry later")
                # NOTE: an accepted request whose decode worker was lost (the pool's only one,
                # or a data-parallel group, restarting) waits for one to join, as for room:
                # its stream goes on where it stopped. Only its own timeout bounds the wait.
                wait_s = self._backoff(
                    num_waits, deadline, "a decode worker to come back", last_error
                )
                if not awaiting_worker:
                    logger.info("request %s waits for a decode worker", request.request_id)
                    awaiting_worker = True
                num_waits += 1
                await asyncio.sleep(wait_s)
                continue
            try:
                await self._attempt.run(sample, prompt_ids, decode, tries, deadline, updates)
                return
            except RetryAttempt as e:
                last_error = str(e)
                if e.outcome is Outcome.WORKER_FULL:
                    # NOTE: no room is a reason to wait, not a failure: blocks free up as
                    # other requests finish (after a failover the survivors are full for a
                    # while). Only the request's own timeout bounds the wait.
                    wait_s = self._backoff(
                        num_waits, deadline, "room on a decode worker", last_error
                    )
                    if num_waits == 0:
                        logger.info("request %s waits for room: %s", request.request_id, e)
                    num_waits += 1
                    await asyncio.sleep(wait_s)
                    continue
                num_failed += 1
                failed_on.append(decode.name)
                self.transfers.count_migration(last_error)
                logger.warning("request %s attempt %d: %s", request.request_id, tries, e)
            if num_failed >= self.config.max_attempts or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05 * num_failed)
        raise EngineDeadError(
            f"request {request.request_id} failed after {num_failed} attempt(s): {last_error}"
        )

    def _backoff(self, num_waits: int, deadline: float, waiting_for: str, last_error: str) -> float:
        """The next wait of a request that waits (for room, for a decode worker), backing off
        from ROOM_WAIT_MIN_S to ROOM_WAIT_MAX_S; raises `EngineDeadError` when it would end
        past the request's `deadline`."""
        wait_s = min(ROOM_WAIT_MAX_S, ROOM_WAIT_MIN_S * 2.0 ** min(num_waits, 30))
        if time.monotonic() + wait_s >= deadline:
            raise EngineDeadError(
                f"request timed out after {self.config.request_timeout_s}s waiting for "
                f"{waiting_for} ({last_error})"
            )
        return wait_s
