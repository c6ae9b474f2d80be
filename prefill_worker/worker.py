"""`PrefillWorker`: the prefill half of disaggregated requests.

Each request is prefilled (chunked, under the token budget, reusing prefix-cached blocks),
its first token is sampled with the request's own sampling parameters, and its KV blocks go to
the decode worker named by `dest`, together with the first token, its logprobs and its
sampling seed (the decode side continues exactly where this side stopped: each draw is keyed
by the seed and the token's position). The blocks
stay held until the decode side acknowledges, or the transfer fails or its lease
(`kv_lease_s`) runs out; then they are freed, full ones staying in the prefix cache.
With `kv_layerwise` (the default) the transfer opens before the forward pass that completes
the prompt, each layer's blocks leave as soon as the pass wrote them, and the first token
follows as the transfer's trailer; a prompt prefilled in several chunks sends the layers of
its earlier chunks during that last pass too.

Threads: the `EngineCore` thread owns the `LLMEngine` and the `KVSender` (through
`PrefillRole`); `prefill`/`abort` may be called from any thread or event loop and talk to it
through the core's typed commands.

Tensor and pipeline parallelism: every rank of the group runs a `PrefillWorker` with an
identical engine (its stage's layers);
rank 0 takes the requests and the core broadcasts, each iteration, the commands every rank
applies (add, abort, release), so that every rank's scheduler makes the same decisions and the
collectives line up. Each rank ships each rank of the decode worker the KV heads it caches
(`FanOutKVSender`, `layout.head_route`), of its stage's layers, as the pass computes them; a
request's transfer is over once the ranks of every stage agree it is (`RankAgreement`: each
rank's parts end at their own time), and rank 0 then releases it on every rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from duet.cluster_auth import load_cluster_secret
from duet.engine import SamplingParams
from duet.engine.core import (
    AbortRequest,
    AddRequest,
    EngineCore,
    EngineDeadError,
    EngineRole,
    ReleaseHeld,
)
from duet.engine.llm_engine import LLMEngine, PrefillDone
from duet.engine.outputs import EngineOutput
from duet.engine.parallel import SINGLE, TensorParallel
from duet.engine.peer_lockstep import PeerLockstep
from duet.kv_transfer import (
    HandshakeError,
    KVLayout,
    KVSender,
    SenderConfig,
    TransferResult,
    TransferStatus,
    create_sender,
)
from duet.kv_transfer.factory import resolve_backend
from duet.kv_transfer.fanout import FanOutKVSender
from duet.kv_transfer.rank_agreement import RankAgreement
from duet.prefill_worker.config import PrefillWorkerConfig
from duet.prefill_worker.draft_prefill import DraftPrefill, prefill_engine_config
from duet.prefill_worker.prefix_index import PrefixCacheIndex
from duet.prefill_worker.results import PrefillLoad, PrefillResult
from duet.wire.handoff import PrefillHandoff

__all__ = ["PrefillLoad", "PrefillResult", "PrefillRole", "PrefillWorker"]

logger = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(
        self,
        config: PrefillWorkerConfig,
        tp: TensorParallel = SINGLE,
        name: str = "prefill",
        sender_options: dict[str, Any] | None = None,
        control_group: dist.ProcessGroup | None = None,
        peers: PeerLockstep | None = None,
    ) -> None:
        """`tp`: this rank's group when `config.tensor_parallel_size` > 1. `control_group`: a
        gloo group over the same ranks for the command broadcast (default `tp.group`, which
        must then be gloo). `sender_options`: the KV backend's own sender options (the local backend's
        `hub`, tcp's `stripes`) or a setting to override; one the backend does not take is
        an error naming it. `peers`: with `config.data_parallel_size` > 1, the other prefill
        workers of its data-parallel group, each a whole worker, that its engine steps with
        (`tp` then holds the expert exchange; engine/peer_lockstep.py)."""
        self.config = config
        self.tp = tp
        self.name = name
        self.sender_options = dict(sender_options or {})
        # Set by `PrefillRole.start` on the engine thread (see `EngineCore`'s note).
        self.layout: KVLayout
        self.kv_backend: str
        self.sender: KVSender
        self.load = PrefillLoad()
        self.prefix_index = PrefixCacheIndex()
        self.role = PrefillRole(self)
        self.core = EngineCore(
            lambda: LLMEngine(prefill_engine_config(config), tp),
            self.role,
            name=name,
            tp=tp,
            control_group=control_group,
            peers=peers,
        )
        self.core.wait_ready()
        self.engine = self.core.engine

    # -- API (any thread) --------------------------------------------------------------------

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

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        dest: str,
        num_replayed: int = 0,
        priority: int = 0,
    ) -> PrefillResult:
        """Prefill, sample the first token and ship the KV to the decode worker at `dest`.
        Returns once the transfer ended. Bad input raises `InvalidInputError`; cancelling
        the call aborts the request (its blocks are freed)."""
        if not self.is_running:
            raise RuntimeError(f"prefill worker {self.name} is not running") from self.core.dead
        ids = list(prompt_token_ids)
        self.engine.tokenize_prompt(ids)  # validates ids
        self.engine.check_lengths(len(ids), params)
        if params.structured_outputs is not None:  # compiled off the engine thread
            await asyncio.to_thread(self.engine.grammar_compiler.compile, params.structured_outputs)
        request_id, out_queue = self.core.open_stream(request_id)
        self.core.submit(
            AddRequest(
                request_id, ids, params, priority, prefill_dest=dest, num_replayed=num_replayed
            )
        )
        finished = False
        try:
            item = await out_queue.get()
            finished = True
        finally:
            self.core.close_stream(request_id, finished)  # cancelled: aborts the request
        if isinstance(item, EngineDeadError):  # the worker stopped: another one may serve it
            return PrefillResult(request_id, TransferStatus.FAILED, str(item), retryable=True)
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, PrefillResult)
        return item

    def abort(self, request_id: str) -> None:
        self.core.submit(AbortRequest(request_id))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread (followers stop with rank 0) and close the sender."""
        self.core.shutdown(timeout_s)
        self.role.close()

    def join(self, timeout_s: float | None = None) -> None:
        """Block until the engine thread ends (a follower rank's main thread waits here)."""
        self.core.join(timeout_s)


class PrefillRole(EngineRole):
    """The prefill worker's hooks on the engine thread: prefill-only requests, shipping each
    one's KV when its first token is out (layer-wise when the transfer opened before the
    last pass: the `PrefillStream` the engine calls), polling the sender, releasing blocks
    once a transfer ended, and the prefix index and load snapshot."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker
        self.rank = worker.tp.global_rank  # 0: the rank that serves (stage 0's TP rank 0)
        self._dest: dict[str, str] = {}  # request id -> decode worker's KV address
        self._in_flight: dict[str, PrefillDone] = {}  # shipped, waiting for the outcome
        self._begun: set[str] = set()  # layer-wise transfers opened before their last pass
        self._shipped_s: dict[str, float] = {}  # request id -> when its prefill ended
        # Queue times, for traces only (set by a server that traces; off: no bookkeeping).
        self.record_queue_times = False
        self._added_s: dict[str, float] = {}  # added, not scheduled yet: when it arrived
        self._queued_s: dict[str, float] = {}  # request id -> arrival to its first step
        self._step_s = 0.0  # when the current step began
        self._block_bytes = 0  # one block's KV over every layer and TP rank
        self.drafts: DraftPrefill | None = None  # the draft's KV, when shipped from here
        self._draft_block_bytes = 0
        self._agreement = RankAgreement()  # set up in `start`

    def start(self) -> None:
        """The KV sender over the engine's caches, and the prefix index's event feed (built
        on the engine thread)."""
        worker, config, engine = self.worker, self.worker.config, self.engine
        caches = engine.runner.kv_caches  # this rank's stage's layers
        tp, pp = worker.tp, worker.tp.pp
        num_layers = engine.arch.num_hidden_layers
        # [2, num_blocks, block_size, heads, head_dim] per layer; every rank holds 1/tp of it
        layer_bytes = caches[0].nbytes // caches[0].shape[1]
        self._block_bytes = layer_bytes * num_layers * tp.world_size
        worker.layout = KVLayout.of_caches(
            config.model or "default", caches, engine.arch.num_key_value_heads, tp.world_size,
            tp.rank, pp.num_stages, pp.stage, num_layers,
        )  # fmt: skip
        self.drafts = DraftPrefill.of_engine(engine)
        draft_caches = None
        if self.drafts is not None:  # its layers travel after the target's
            draft_caches = self.drafts.kv_caches
            worker.layout = worker.layout.with_draft(self.drafts.model_id, draft_caches)
            self._draft_block_bytes = sum(c.nbytes // c.shape[1] for c in draft_caches)
        worker.kv_backend = resolve_backend(config.kv_backend, caches)
        secret = load_cluster_secret()

        def make_sender(index: int) -> KVSender:
            """The backend sender to rank `index` of decode workers."""
            suffix = f"-d{index}" if index else ""  # rank 0's name stays the worker's own
            stage = f"-pp{pp.stage}" if pp.stage else ""
            settings = SenderConfig(
                name=f"{worker.name}-tp{tp.rank}{stage}{suffix}",
                timeout_s=config.kv_transfer_timeout_s,
                ack_timeout_s=config.kv_lease_s,
                secret=secret,
                measure_link=tp.global_rank == 0 and index == 0,  # whose results reach the router
                staging_bytes=config.kv_staging_bytes,
            )
            return create_sender(
                worker.kv_backend, caches, worker.layout, settings, draft_caches,
                **worker.sender_options,
            )  # fmt: skip

        self.sender = worker.sender = FanOutKVSender(make_sender, worker.layout)
        self.sender.sender(0)  # a bad backend option fails the start, not the first request
        # the group's ranks (TP x PP), not config.num_ranks: data-parallel peers are whole
        # workers, each agreeing alone
        ranks = tp.world_size * tp.pp.num_stages
        self._agreement = RankAgreement(tp.global_rank, ranks, self.core.control_group)
        engine.kv.pool.record_events = config.enable_prefix_caching
        if config.kv_layerwise:
            engine.prefill_stream = self
        self._update_load()

    def add(self, cmd: AddRequest) -> None:
        if cmd.prefill_dest is None:
            raise ValueError("prefill_dest: a prefill worker needs the decode worker's address")
        self.engine.add_request(
            cmd.prompt,
            cmd.params,
            cmd.request_id,
            cmd.priority,
            prefill_only=True,
            num_replayed=cmd.num_replayed,
        )
        self._dest[cmd.request_id] = cmd.prefill_dest
        if self.drafts is not None:
            assert not isinstance(cmd.prompt, str)  # `prefill` passes token ids
            self.drafts.add(cmd.request_id, cmd.prompt)
        if self.record_queue_times:
            self._added_s[cmd.request_id] = time.monotonic()

    def abort(self, cmd: AbortRequest) -> None:
        if self.engine.abort(cmd.request_id) is not None:
            self._dest.pop(cmd.request_id, None)
            self._added_s.pop(cmd.request_id, None)
            self._queued_s.pop(cmd.request_id, None)
            if self.drafts is not None:
                self.drafts.release(cmd.request_id)
            self.core.publish(cmd.request_id, PrefillResult(cmd.request_id, TransferStatus.ABORTED))
        elif cmd.request_id in self._in_flight:
            self.sender.abort(cmd.request_id)  # reported by the next poll

    def release(self, cmd: ReleaseHeld) -> None:
        self._added_s.pop(cmd.request_id, None)
        self._queued_s.pop(cmd.request_id, None)
        self._in_flight.pop(cmd.request_id, None)
        self._shipped_s.pop(cmd.request_id, None)
        self._dest.pop(cmd.request_id, None)
        self.engine.release_held(cmd.request_id)
        if self.drafts is not None:
            self.drafts.release(cmd.request_id)
        if cmd.result is not None:
            self.core.publish(cmd.request_id, cmd.result)  # after the release: a whole pool

    def before_step(self) -> None:
        self._step_s = time.monotonic()

    def after_step(self, outputs: list[EngineOutput]) -> None:
        if self._added_s:  # the queue time of requests this step started (for their traces)
            waiting = {r.request_id for r in self.engine.scheduler.waiting}
            for request_id in [r for r in self._added_s if r not in waiting]:
                added_s = self._added_s.pop(request_id)
                self._queued_s[request_id] = max(0.0, self._step_s - added_s)
        for done in self.engine.take_prefilled():
            self.ship(done)
        self._poll_sender()
        self.worker.prefix_index.apply(self.engine.kv.pool.take_events())
        self._update_load()

    def has_io_in_flight(self) -> bool:
        return bool(self._in_flight)

    def close(self) -> None:
        """Close the sender (after the loop stopped); nothing to close if start-up failed."""
        sender = getattr(self, "sender", None)
        if sender is not None:
            sender.close()

    def begin(self, requests: list[tuple[str, list[int]]]) -> Callable[[int], None] | None:
        """`PrefillStream`: open layer-wise transfers for the requests the coming pass
        completes; the sender ships each layer as the pass writes it (the draft's KV, computed
        first, after them)."""
        drafts = self.drafts.prefill([r for r, _ in requests]) if self.drafts else {}
        for request_id, block_ids in requests:
            dest, draft = self._dest[request_id], drafts.get(request_id)
            try:
                if self.sender.begin(request_id, block_ids, dest, draft):
                    self._begun.add(request_id)
            except HandshakeError as e:  # `ship` sends it whole, and fails the same way
                logger.error("KV handshake for %s failed: %s", request_id, e)
            except Exception:  # e.g. out of memory: `ship` tries it whole, and fails that one
                logger.exception("opening the KV transfer of %s failed", request_id)
        return self.sender.layer_computed if self._begun else None

    def ship(self, done: PrefillDone) -> None:
        """Send a prefilled request's KV (finish the layer-wise transfer begun before its
        last pass, or send it whole)."""
        self._in_flight[done.request_id] = done
        self._shipped_s[done.request_id] = time.monotonic()
        dest = self._dest[done.request_id]
        try:
            if done.request_id in self._begun:
                self._begun.discard(done.request_id)
                self.sender.finish(done.request_id, PrefillHandoff.of(done).to_meta())
            else:
                drafts = self.drafts.prefill([done.request_id]) if self.drafts else {}
                self.sender.send(
                    done.request_id, done.block_ids, dest, PrefillHandoff.of(done).to_meta(),
                    drafts.get(done.request_id),
                )  # fmt: skip
        except HandshakeError as e:  # a misconfigured pair: no retry helps
            logger.error("KV handshake for %s failed: %s", done.request_id, e)
            self._agreement.record(
                TransferResult(done.request_id, TransferStatus.FAILED, str(e), retryable=False)
            )
        except Exception as e:  # e.g. out of memory: this transfer fails, never the worker
            # NOTE: a sender raises only before it opened the transfer (poll never reports it)
            logger.exception("the KV transfer of %s failed", done.request_id)
            self._agreement.record(
                TransferResult(done.request_id, TransferStatus.FAILED, str(e), retryable=True)
            )

    def _poll_sender(self) -> None:
        """This rank's outcomes, then the group's (every rank, the same iteration)."""
        for result in self.sender.poll():
            if result.status == TransferStatus.FAILED:
                logger.warning(
                    "KV transfer of %s failed: %s", result.request_id, result.error
                )  # fmt: skip
            self._agreement.record(result)
        for result in self._agreement.settle(list(self._in_flight)):
            self._finish_transfer(result)

    def _finish_transfer(self, result: TransferResult) -> None:
        if self.rank != 0:
            return  # rank 0 decides when every rank releases
        done = self._in_flight.get(result.request_id)
        shipped_s = self._shipped_s.get(result.request_id)
        num_bytes = len(done.block_ids) * self._block_bytes if done else 0
        if self.drafts is not None:
            num_bytes += self.drafts.num_blocks(result.request_id) * self._draft_block_bytes
        outcome = PrefillResult(
            result.request_id,
            result.status,
            result.error,
            result.retryable,
            done.first_token if done else None,
            done.num_cached_tokens if done else 0,
            num_bytes,
            time.monotonic() - shipped_s if shipped_s is not None else 0.0,
            self._queued_s.get(result.request_id, 0.0),
            done.prompt_logprobs if done else None,
            result.num_chunks,
            result.link_gbps or 0.0,
            time.time_ns(),
        )
        self.core.submit_internal(ReleaseHeld(result.request_id, outcome))

    def _update_load(self) -> None:
        sched = self.engine.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.running)
        queued += sum(r.num_tokens for r in sched.waiting)
        self.worker.load = PrefillLoad(
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            num_transferring=len(self._in_flight),
            num_queued_tokens=queued,
            num_free_blocks=self.engine.kv.num_free_blocks,
            num_blocks=self.engine.num_blocks,
        )
