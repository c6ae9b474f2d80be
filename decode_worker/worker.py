"""`DecodeWorker`: continuous-batched decode of requests whose prompt KV was computed by a
prefill worker, and local generation for the rest (conditional disaggregation).

A remote request goes through three states. `reserve` takes a sequence slot and blocks for
its prompt (or fails at once with `NoCapacityError`, so the router can pick another worker)
and tells the KV receiver to expect it: WAITING_FOR_REMOTE_KV, never in the batch and never
blocking it. When the receiver reports the KV written, the first token that came with it is
taken as if sampled here (same detokenization, stop rules and logprobs as an aggregated run,
and its sampling seed continues), and the request joins the running batch at the
next step. If the KV does not arrive within its wait, or its sender is lost, the reservation
is freed and the stream ends with `KVTransferError` (retryable).

With a draft model whose prompt KV the prefill worker computes (`speculative_config`'s
`draft_prefill`), a reservation also takes the draft's blocks for the prompt (its shadow holds
them) and the KV receiver lands the draft's layers there; the shadow then starts with the
prompt computed. Without them (a full draft pool, or a prefill worker that sent none) the
shadow computes the prompt here at the request's first proposal, as without disaggregation.

Tensor parallelism: every rank of a decode worker runs a `DecodeWorker` with an identical
engine and a KV receiver of its own over its caches; the worker's KV address names them all, in
rank order (`kv_transfer.fanout.join_addresses`), and each prefill rank sends each decode rank
the heads it caches. Rank 0 takes the requests; the core broadcasts the commands every rank
applies (a reservation reserves the same blocks on every rank). A request's KV lands on the
ranks at different times, but it joins the batch on every rank at the same step: the ranks
agree on each reservation's outcome (`RankAgreement`, rank 0's first token) before the
scheduler sees it (docs/parallelism.md).

Data-parallel attention (a mixture of experts, `data_parallel_size` D): D decode workers, each
a whole worker (its own server, KV receiver, scheduler and requests; the router sees D
workers), hold 1/D of the routed experts each and exchange them, stepping as peers
(engine/peer_lockstep.py: every worker steps when any has work).

Threads: the `EngineCore` thread runs the engine and polls the receiver (`DecodeRole`);
callers use any event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch.distributed as dist

from duet.cluster_auth import load_cluster_secret
from duet.decode_worker.config import DecodeWorkerConfig
from duet.engine import RequestOutput, SamplingParams
from duet.engine.async_engine import AsyncEngine
from duet.engine.core import AbortRequest, AddRequest, EngineDeadError, EngineRole, ReserveRemote
from duet.engine.llm_engine import LLMEngine, Prompt
from duet.engine.outputs import EngineOutput
from duet.engine.parallel import SINGLE, TensorParallel
from duet.engine.peer_lockstep import PeerLockstep
from duet.engine.spec_decode.draft_model import DraftModelProposer
from duet.kv_transfer import KVLayout, KVReceiver, ReceiverConfig, TransferStatus, create_receiver
from duet.kv_transfer.factory import resolve_backend
from duet.kv_transfer.fanout import join_addresses
from duet.kv_transfer.rank_agreement import RankAgreement
from duet.v1 import worker_pb2
from duet.wire.deltas import delta_of
from duet.wire.handoff import PrefillHandoff

T = TypeVar("T")


class NoCapacityError(RuntimeError):
    """No free sequence slot or too few free KV blocks for the prompt; try another worker."""


class KVTransferError(RuntimeError):
    """The prompt's KV never arrived (timeout, or its sender went away); retryable."""


@dataclass(frozen=True)
class Reservation:
    request_id: str
    kv_address: str  # where the prefill worker sends the KV
    num_blocks: int


@dataclass(frozen=True)
class DecodeLoad:
    """A snapshot for routing, refreshed by the engine thread every iteration."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_kv: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    max_num_seqs: int = 0


class RemoteDecode(Generic[T]):
    """A reserved request: iterate its outputs (first token included): `RequestOutput`s
    (`DecodeWorker.reserve`) or wire deltas (`reserve_deltas`). Leaving `async with` (or
    `aclose`) before it finished aborts it and frees its blocks."""

    def __init__(
        self,
        worker: DecodeWorker,
        reservation: Reservation,
        outputs: AsyncGenerator[T, None],
    ) -> None:
        self.worker = worker
        self.reservation = reservation
        self._outputs = outputs

    def __aiter__(self) -> AsyncGenerator[T, None]:
        return self._outputs

    async def aclose(self) -> None:
        await self._outputs.aclose()
        # A stream never iterated has not registered its own cleanup: do it here.
        self.worker.core.close_stream(self.reservation.request_id, finished=False)

    async def __aenter__(self) -> RemoteDecode[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class DecodeWorker:
    """A decode worker: an `AsyncEngine` whose role (`DecodeRole`) also takes reservations
    and polls the KV receiver. `generate` serves local requests (conditional
    disaggregation); `reserve` the remote ones."""

    def __init__(
        self,
        config: DecodeWorkerConfig,
        name: str = "decode",
        receiver_options: dict[str, Any] | None = None,
        tp: TensorParallel = SINGLE,
        control_group: dist.ProcessGroup | None = None,
        peers: PeerLockstep | None = None,
    ) -> None:
        """`receiver_options`: the KV backend's own receiver options (the local backend's
        `hub`) or a setting to override (its `name`, the local backend's address; default
        `name`); one the backend does not take is an error naming it. `tp`: this rank's
        group when `config.tensor_parallel_size` > 1 (`decode_worker/launch.py`), with
        `control_group`, a gloo group over the same ranks (default `tp.group`). `peers`:
        with `config.data_parallel_size` > 1, the other decode workers of its data-parallel
        group, each a whole worker of its own, that its engine steps with (`tp` then holds
        the expert exchange)."""
        self.config = config
        self.name = name
        self.tp = tp
        self.receiver_options = dict(receiver_options or {})
        # Set by `DecodeRole.start` on the engine thread (see `EngineCore`'s note).
        self.layout: KVLayout
        self.kv_backend: str
        self.receiver: KVReceiver
        self.kv_address: str
        self.load = DecodeLoad(max_num_seqs=config.max_num_seqs)
        self.client = AsyncEngine(
            lambda: LLMEngine(config, tp), DecodeRole(self), name=name, tp=tp,
            control_group=control_group, peers=peers,
        )  # fmt: skip
        self.core = self.client.core
        self.engine = self.client.engine

    @property
    def is_running(self) -> bool:
        return self.core.is_running

    @property
    def failed(self) -> bool:
        """Whether its engine ended by a failure, not a stop (the process then exits 1)."""
        return self.core.failed

    @property
    def deterministic(self) -> bool:
        """Whether its tokens are independent of batching and chunking (engine.deterministic)."""
        return self.engine.deterministic

    @property
    def speculates_with_ngram(self) -> bool:
        """Whether it proposes with ngram, and so takes Predicted Outputs."""
        return self.client.speculates_with_ngram

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        num_replayed: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """A local request, prefilled and decoded here (see `AsyncEngine.generate`)."""
        return self.client.generate(prompt, params, request_id, priority, num_replayed)

    async def generate_deltas(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        num_replayed: int = 0,
    ) -> AsyncGenerator[worker_pb2.OutputDelta, None]:
        """`generate` as the router receives it: each step's token ids and logprobs, never
        text (the router detokenizes). Bad input raises `InvalidInputError` at the first
        iteration, before anything is queued."""
        if self.core.dead is not None:
            raise EngineDeadError("decode worker is not running") from self.core.dead
        ids = list(prompt_token_ids)
        self.engine.tokenize_prompt(ids)  # validates the ids
        self.engine.check_lengths(len(ids), params)
        if params.structured_outputs is not None:  # compiled off the engine thread
            await asyncio.to_thread(self.engine.grammar_compiler.compile, params.structured_outputs)
        request_id, out_queue = self.core.open_stream(request_id)
        self.core.submit(AddRequest(request_id, ids, params, priority, num_replayed=num_replayed))
        async with aclosing(self._deltas(request_id, out_queue)) as deltas:
            async for delta in deltas:
                yield delta

    def abort(self, request_id: str) -> None:
        self.core.submit(AbortRequest(request_id))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread (the receiver closes with it; followers stop with rank 0);
        streams end with `EngineDeadError`."""
        self.core.shutdown(timeout_s)

    def join(self, timeout_s: float | None = None) -> None:
        """Block until the engine thread ends (a follower rank's main thread waits here)."""
        self.core.join(timeout_s)

    async def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        kv_wait_s: float | None = None,
        num_replayed: int = 0,
        priority: int = 0,
    ) -> RemoteDecode[RequestOutput]:
        """Reserve blocks for a prompt whose KV a prefill worker will send to `kv_address`
        under `request_id`; its outputs with their text. Raises `NoCapacityError` (nothing
        reserved), `InvalidInputError` for bad input, `EngineDeadError` when the worker
        stopped."""
        ids = list(prompt_token_ids)
        reservation, out_queue = await self._reserve(
            request_id, ids, params, kv_wait_s, num_replayed, priority
        )
        request_id = reservation.request_id
        assembler = self.engine.new_assembler(request_id, None, ids, params)
        return RemoteDecode(self, reservation, self.core.iterate(request_id, out_queue, assembler))

    async def reserve_deltas(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        kv_wait_s: float | None = None,
        num_replayed: int = 0,
        priority: int = 0,
    ) -> RemoteDecode[worker_pb2.OutputDelta]:
        """`reserve` as the router receives it: token ids and logprobs, never text."""
        reservation, out_queue = await self._reserve(
            request_id, list(prompt_token_ids), params, kv_wait_s, num_replayed, priority
        )
        outputs = self._deltas(reservation.request_id, out_queue)
        return RemoteDecode(self, reservation, outputs)

    async def _reserve(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        kv_wait_s: float | None,
        num_replayed: int,
        priority: int,
    ) -> tuple[Reservation, asyncio.Queue[Any]]:
        if self.core.dead is not None:
            raise EngineDeadError("decode worker is not running") from self.core.dead
        self.engine.tokenize_prompt(ids)
        self.engine.check_lengths(len(ids), params)
        if params.structured_outputs is not None:  # compiled off the engine thread
            await asyncio.to_thread(self.engine.grammar_compiler.compile, params.structured_outputs)
        request_id, out_queue = self.core.open_stream(request_id)
        wait_s = kv_wait_s or self.config.kv_wait_s
        self.core.submit(ReserveRemote(request_id, ids, params, wait_s, num_replayed, priority))
        try:
            first = await out_queue.get()
        except BaseException:
            self.core.close_stream(request_id, finished=False)
            raise
        if isinstance(first, BaseException):
            self.core.close_stream(request_id, finished=True)
            raise first
        assert isinstance(first, Reservation)
        return first, out_queue

    async def _deltas(
        self, request_id: str, out_queue: asyncio.Queue[Any]
    ) -> AsyncGenerator[worker_pb2.OutputDelta, None]:
        """The request's raw outputs as wire deltas until it finished (`EngineCore.iterate`
        without the assembler: no text, no stop strings, which are the router's); exceptions
        published for it are raised. Leaving early aborts the request."""
        finished = False
        try:
            while True:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield delta_of(item)
                if finished:
                    return
        finally:
            self.core.close_stream(request_id, finished)

    async def generate_remote(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        kv_wait_s: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """`reserve`, then stream the outputs (for callers that need no reservation info)."""
        remote = await self.reserve(request_id, prompt_token_ids, params, kv_wait_s)
        async with remote, aclosing(remote.__aiter__()) as outputs:
            async for out in outputs:
                yield out


class DecodeRole(EngineRole):
    """The decode worker's hooks on the engine thread: reservations, the receiver's poll,
    aborts that also drop late KV, and the load snapshot."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker
        self.draft: DraftModelProposer | None = None  # whose prompt KV prefill workers send
        self.agreement = RankAgreement()  # set up in `start`

    def start(self) -> None:
        """The KV receiver, over the engine's caches and, when prefill workers compute the
        draft's prompt KV, the draft's (built on the engine thread)."""
        worker, config, tp = self.worker, self.worker.config, self.worker.tp
        caches = self.engine.runner.kv_caches
        worker.layout = KVLayout.of_caches(
            config.model or "default", caches, self.engine.arch.num_key_value_heads,
            tp.world_size, tp.rank,
        )  # fmt: skip
        spec, speculator = config.speculative(), self.engine.speculator
        draft_caches = None
        if spec is not None and spec.drafts_on_prefill and speculator is not None:
            assert isinstance(speculator.proposer, DraftModelProposer) and spec.model
            self.draft = speculator.proposer
            draft_caches = self.draft.runner.kv_caches
            worker.layout = worker.layout.with_draft(spec.model, draft_caches)
        worker.kv_backend = resolve_backend(config.kv_backend, caches)
        settings = ReceiverConfig(
            name=f"{worker.name}-tp{tp.rank}" if tp.rank else worker.name,
            timeout_s=config.kv_transfer_timeout_s,
            host=config.kv_host,
            port=config.kv_port,
            advertise_host=config.kv_advertise_host,
            secret=load_cluster_secret(),
            staging_bytes=config.kv_staging_bytes,
        )
        self.receiver = worker.receiver = create_receiver(
            worker.kv_backend, caches, worker.layout, settings, draft_caches,
            **worker.receiver_options,
        )  # fmt: skip
        worker.kv_address = self.receiver.address
        if tp.enabled:  # every rank's receiver, in rank order
            addresses: list[object] = [None] * tp.world_size
            dist.all_gather_object(addresses, self.receiver.address, group=self.core.control_group)
            worker.kv_address = join_addresses([str(a) for a in addresses])
        self.agreement = RankAgreement(
            tp.rank, tp.world_size, self.core.control_group, share_meta=True
        )
        self._update_load()

    def reserve(self, cmd: ReserveRemote) -> None:
        engine = self.engine
        block_ids = engine.add_remote_request(
            cmd.prompt_token_ids, cmd.params, cmd.request_id, cmd.num_replayed, cmd.priority
        )
        if block_ids is None:
            raise NoCapacityError(
                f"decode worker {self.worker.name}: no room for {len(cmd.prompt_token_ids)} "
                f"prompt tokens ({engine.kv.num_free_blocks} free blocks, "
                f"{engine.scheduler.num_seq_slots_used}/{engine.config.max_num_seqs} sequences)"
            )
        draft_ids = None
        spec = self.draft.config if self.draft is not None else None
        if spec is not None and spec.prefills_draft_remotely(len(cmd.prompt_token_ids)):
            assert self.draft is not None
            draft_ids = self.draft.reserve_prompt(cmd.request_id, cmd.prompt_token_ids)
        self.receiver.expect(cmd.request_id, block_ids, cmd.kv_wait_s, draft_ids)
        self.core.publish(
            cmd.request_id, Reservation(cmd.request_id, self.worker.kv_address, len(block_ids))
        )

    def abort(self, cmd: AbortRequest) -> None:
        self.receiver.abort(cmd.request_id)  # late KV for it is dropped
        super().abort(cmd)

    def before_step(self) -> None:
        """This rank's KV outcomes, then the group's: a reservation's KV joins the batch once
        every rank has it, on every rank at this same step."""
        for result in self.receiver.poll():
            self.agreement.record(result)
        for result in self.agreement.settle(list(self.engine.scheduler.waiting_for_kv)):
            request_id = result.request_id
            if result.status == TransferStatus.DONE:
                if self.draft is not None:
                    self.draft.prompt_received(request_id, result.draft)
                try:
                    handoff = PrefillHandoff.from_meta(result.meta)
                except ValueError as e:
                    self._fail(request_id, str(e))
                    continue
                out = self._complete(request_id, handoff)
                if out is not None:
                    self.core.publish(request_id, out)
            elif result.status == TransferStatus.FAILED:
                self._fail(request_id, f"did not arrive: {result.error}")
        self._update_load()

    def _fail(self, request_id: str, why: str) -> None:
        self.engine.abort(request_id)
        self.core.publish(request_id, KVTransferError(f"KV of {request_id} {why}"))

    def _complete(self, request_id: str, handoff: PrefillHandoff) -> EngineOutput | None:
        return self.engine.complete_remote(
            request_id,
            handoff.first_token,
            handoff.logprob,
            handoff.sample_seed,
            handoff.num_cached_tokens,
        )

    def _update_load(self) -> None:
        sched = self.engine.scheduler
        self.worker.load = DecodeLoad(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_waiting_for_kv=len(sched.waiting_for_kv),
            num_free_blocks=self.engine.kv.num_free_blocks,
            num_blocks=self.engine.num_blocks,
            max_num_seqs=self.engine.config.max_num_seqs,
        )

    def on_exit(self) -> None:
        self.receiver.close()
