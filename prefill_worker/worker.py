"""`PrefillWorker`: the prefill half of disaggregated requests.

Each request is prefilled (chunked, under the token budget, reusing prefix-cached blocks),
its first token is sampled with the request's own sampling parameters, and its KV blocks go to
the decode worker named by `dest`, together with the first token, its logprobs and the seeded
generator's state (the decode side continues exactly where this side stopped). The blocks
stay held until the decode side acknowledges, or the transfer fails or its lease
(`kv_lease_s`) runs out; then they are freed, full ones staying in the prefix cache.
With `kv_layerwise` (the default) the transfer opens before the forward pass that completes
the prompt, each layer's blocks leave as soon as the pass wrote them, and the first token
follows as the transfer's trailer; a prompt prefilled in several chunks sends the layers of
its earlier chunks during that last pass too.

Threads: one engine thread owns the `LLMEngine` and the `KVSender`; `prefill`/`abort` may be
called from any thread or event loop and talk to it through a command queue.

Tensor parallelism: every rank of the group runs a `PrefillWorker` with an identical engine;
rank 0 takes the requests and, each iteration, broadcasts the commands it will apply (add,
abort, release) so that every rank's scheduler makes the same decisions and the collectives
line up. Each rank ships the KV heads of its shard; the decode side reassembles them.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from engine import SamplingParams
from engine.llm_engine import LLMEngine, PrefillDone
from engine.parallel import SINGLE, TensorParallel
from kv_transfer import (
    HandshakeError,
    KVLayout,
    KVSender,
    TransferResult,
    TransferStatus,
    create_sender,
)
from kv_transfer.factory import resolve_backend
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.prefix_index import PrefixCacheIndex

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5
"""Longest wait for a command while idle; also the heartbeat rank 0 sends its followers."""
_TRANSFER_POLL_S = 0.001
"""Wait between polls of the sender while only transfers are in flight."""


@dataclass(frozen=True)
class PrefillResult:
    """How a request's prefill ended: DONE (KV acknowledged by the decode side), FAILED (with
    `retryable` when another worker or a retry may succeed) or ABORTED."""

    request_id: str
    status: TransferStatus
    error: str | None = None
    retryable: bool = False
    first_token: int | None = None
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class PrefillLoad:
    """A snapshot for routing, refreshed by the engine thread every iteration."""

    num_waiting: int = 0
    num_running: int = 0
    num_transferring: int = 0
    num_queued_tokens: int = 0  # prompt tokens not yet prefilled
    num_free_blocks: int = 0
    num_blocks: int = 0


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    dest: str


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Release:
    request_id: str
    result: PrefillResult | None = None  # rank 0 only: what to tell the caller once released


@dataclass(frozen=True)
class _Stop:
    pass


_Command = _Add | _Abort | _Release | _Stop


def kv_meta(done: PrefillDone) -> dict[str, Any]:
    """What travels with the KV: everything the decode side needs to continue the request."""
    state = done.generator_state
    return {
        "first_token": done.first_token,
        "logprob": done.logprob,
        "generator_state": base64.b64encode(state).decode() if state is not None else None,
        "num_cached_tokens": done.num_cached_tokens,
    }


class PrefillWorker:
    def __init__(
        self,
        config: PrefillWorkerConfig,
        tp: TensorParallel = SINGLE,
        name: str = "prefill",
        sender_options: dict[str, Any] | None = None,
        control_group: dist.ProcessGroup | None = None,
    ) -> None:
        """`tp`: this rank's group when `config.tensor_parallel_size` > 1. `control_group`: a
        gloo group over the same ranks for the command broadcast (default `tp.group`, which
        must then be gloo). `sender_options`: extra arguments of the KV backend's sender."""
        self.config = config
        self.tp = tp
        self.name = name
        self.engine = LLMEngine(config, tp)
        self.layout = KVLayout.of_caches(
            config.model or "default",
            self.engine.runner.kv_caches,
            self.engine.arch.num_key_value_heads,
            tp.world_size,
            tp.rank,
        )
        self.kv_backend = resolve_backend(config.kv_backend, self.engine.runner.kv_caches)
        options = dict(sender_options or {})
        if self.kv_backend in ("torch_dist", "tcp"):
            options = {
                "name": f"{name}-tp{tp.rank}",
                "timeout_s": config.kv_transfer_timeout_s,
                "ack_timeout_s": config.kv_lease_s,
                **options,
            }
        self.sender: KVSender = create_sender(
            self.kv_backend,
            kv_caches=self.engine.runner.kv_caches,
            layout=self.layout,
            **options,
        )
        self._control_group = control_group if control_group is not None else tp.group
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._internal: list[_Command] = []  # rank 0's own follow-ups, broadcast like the rest
        self._lock = threading.Lock()
        self._futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._dest: dict[str, str] = {}  # request id -> decode worker's KV address
        self._in_flight: dict[str, PrefillDone] = {}  # shipped, waiting for the outcome
        self._begun: set[str] = set()  # layer-wise transfers opened before their last pass
        if config.kv_layerwise:
            self.engine.prefill_stream = self
        self._dead: BaseException | None = None
        self.load = PrefillLoad(num_blocks=self.engine.num_blocks)
        self.prefix_index = PrefixCacheIndex()
        self.engine.kv.pool.record_events = config.enable_prefix_caching
        self._thread = threading.Thread(target=self._loop, name=f"duet-{name}", daemon=True)
        self._thread.start()

    # -- API (any thread) --------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        dest: str,
    ) -> PrefillResult:
        """Prefill, sample the first token and ship the KV to the decode worker at `dest`.
        Returns once the transfer ended. Bad input raises `InvalidInputError`; cancelling
        the call aborts the request (its blocks are freed)."""
        if not self.is_running:
            raise RuntimeError(f"prefill worker {self.name} is not running") from self._dead
        ids = list(prompt_token_ids)
        self.engine.tokenize_prompt(ids)  # validates ids
        self.engine.check_lengths(len(ids), params)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[PrefillResult] = loop.create_future()
        with self._lock:
            if request_id in self._futures:
                raise ValueError(f"request_id: {request_id!r} is already being prefilled")
            self._futures[request_id] = (loop, future)
        self._commands.put(_Add(request_id, ids, params, dest))
        try:
            return await future
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        finally:
            with self._lock:
                self._futures.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread (followers stop with rank 0) and close the sender."""
        self._commands.put(_Stop())
        self._thread.join(timeout_s)
        self.sender.close()

    def join(self, timeout_s: float | None = None) -> None:
        """Block until the engine thread ends (a follower rank's main thread waits here)."""
        self._thread.join(timeout_s)

    # -- engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                commands = self._next_commands()
                if self.tp.enabled:
                    box: list[Any] = [commands]
                    dist.broadcast_object_list(box, group=self._control_group, group_src=0)
                    commands = box[0]
                if not self._apply(commands):
                    break
                self.engine.step()
                for done in self.engine.take_prefilled():
                    self._ship(done)
                self._poll_sender()
                self.prefix_index.apply(self.engine.kv.pool.take_events())
                self._update_load()
        except BaseException as e:  # every waiting caller must hear of it
            logger.exception("prefill worker %s failed", self.name)
            self._dead = e
        finally:
            if self._dead is None:
                self._dead = RuntimeError(f"prefill worker {self.name} shut down")
            with self._lock:
                futures = list(self._futures.items())
            for request_id, _ in futures:
                self._resolve(
                    PrefillResult(
                        request_id, TransferStatus.FAILED, str(self._dead), retryable=True
                    )
                )

    def _next_commands(self) -> list[_Command]:
        if self.tp.rank != 0:
            return []  # followers take rank 0's commands from the broadcast
        commands, self._internal = self._internal, []
        if commands or self.engine.has_schedulable_requests():
            timeout = 0.0
        elif self._in_flight:
            timeout = _TRANSFER_POLL_S
        else:
            timeout = _IDLE_WAIT_S
        try:
            if timeout > 0:
                commands.append(self._commands.get(timeout=timeout))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return commands

    def _apply(self, commands: list[_Command]) -> bool:
        """Apply rank 0's commands, in order, on this rank. False on stop."""
        for cmd in commands:
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Add):
                try:
                    self.engine.add_request(
                        cmd.prompt_token_ids, cmd.params, cmd.request_id, prefill_only=True
                    )
                    self._dest[cmd.request_id] = cmd.dest
                except Exception as e:
                    self._fail_future(cmd.request_id, e)
            elif isinstance(cmd, _Abort):
                if self.engine.abort_request(cmd.request_id) is not None:
                    self._dest.pop(cmd.request_id, None)
                    self._resolve(PrefillResult(cmd.request_id, TransferStatus.ABORTED))
                elif cmd.request_id in self._in_flight:
                    self.sender.abort(cmd.request_id)  # reported by the next poll
            else:
                self._in_flight.pop(cmd.request_id, None)
                self._dest.pop(cmd.request_id, None)
                self.engine.release_held(cmd.request_id)
                if cmd.result is not None:
                    self._resolve(cmd.result)  # after the release: the caller sees a whole pool
        return True

    def begin(self, requests: list[tuple[str, list[int]]]) -> Callable[[int], None] | None:
        """`PrefillStream`: open layer-wise transfers for the requests the coming pass
        completes; the sender ships each layer as the pass writes it."""
        for request_id, block_ids in requests:
            try:
                if self.sender.begin(request_id, block_ids, self._dest[request_id]):
                    self._begun.add(request_id)
            except HandshakeError as e:  # `_ship` sends it whole, and fails the same way
                logger.error("KV handshake for %s failed: %s", request_id, e)
        return self.sender.layer_computed if self._begun else None

    def _ship(self, done: PrefillDone) -> None:
        self._in_flight[done.request_id] = done
        dest = self._dest[done.request_id]
        try:
            if done.request_id in self._begun:
                self._begun.discard(done.request_id)
                self.sender.finish(done.request_id, kv_meta(done))
            else:
                self.sender.send(done.request_id, done.block_ids, dest, kv_meta(done))
        except HandshakeError as e:  # a misconfigured pair: no retry helps
            logger.error("KV handshake for %s failed: %s", done.request_id, e)
            self._finish_transfer(
                TransferResult(done.request_id, TransferStatus.FAILED, str(e), retryable=False)
            )

    def _poll_sender(self) -> None:
        for result in self.sender.poll():
            if result.status == TransferStatus.FAILED:
                logger.warning(
                    "KV transfer of %s failed: %s", result.request_id, result.error
                )  # fmt: skip
            self._finish_transfer(result)

    def _finish_transfer(self, result: TransferResult) -> None:
        if self.tp.rank != 0:
            return  # rank 0 decides when every rank releases
        done = self._in_flight.get(result.request_id)
        outcome = PrefillResult(
            result.request_id,
            result.status,
            result.error,
            result.retryable,
            done.first_token if done else None,
            done.num_cached_tokens if done else 0,
        )
        self._internal.append(_Release(result.request_id, outcome))

    def _update_load(self) -> None:
        sched = self.engine.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.running)
        queued += sum(r.num_tokens for r in sched.waiting)
        self.load = PrefillLoad(
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            num_transferring=len(self._in_flight),
            num_queued_tokens=queued,
            num_free_blocks=self.engine.kv.num_free_blocks,
            num_blocks=self.engine.num_blocks,
        )

    def _resolve(self, result: PrefillResult) -> None:
        self._settle(result.request_id, result, None)

    def _fail_future(self, request_id: str, error: BaseException) -> None:
        self._settle(request_id, None, error)

    def _settle(
        self, request_id: str, result: PrefillResult | None, error: BaseException | None
    ) -> None:
        with self._lock:
            entry = self._futures.get(request_id)
        if entry is None:
            return
        loop, future = entry

        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is waiting
