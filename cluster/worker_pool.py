"""`WorkerPool`: the router's view of the prefill and decode workers, and its routing policy.

Membership comes from the cluster controller (`set_workers`, any thread). Health and load
come from polling each worker's `GetLoad` every `poll_interval_s`: a worker that fails
`unhealthy_after` polls in a row, or whose connection a request finds broken, gets no new
requests until it answers again. Prefill workers' load reports carry their prefix-cache
events, mirrored here as a set of block hashes per worker.

Routing:
- prefill: the worker holding the longest cached prefix of the prompt (in full blocks), then
  the fewest queued prompt tokens (its report plus what the router sent since);
- decode: among workers with a free sequence slot and enough free blocks for the prompt, the
  least loaded (running + waiting for KV + just sent, over capacity), then the most free blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from duet.cluster.decode_client import DecodeClient
from duet.cluster.prefill_client import PrefillClient
from duet.engine.block_pool import BlockHash, hash_request_blocks
from duet.v1 import worker_pb2

logger = logging.getLogger(__name__)


@dataclass
class PrefillState:
    name: str
    client: PrefillClient
    healthy: bool = False
    failures: int = 0
    worker_id: str = ""
    block_size: int = 0
    num_queued_tokens: int = 0  # last report
    num_sent_tokens: int = 0  # sent by this router and not finished yet
    num_free_blocks: int = 0
    num_blocks: int = 0
    deterministic: bool = False
    last_event: int = 0
    cached: set[BlockHash] = field(default_factory=set)

    @property
    def queued_tokens(self) -> int:
        return self.num_queued_tokens + self.num_sent_tokens


@dataclass
class DecodeState:
    name: str
    client: DecodeClient
    healthy: bool = False
    failures: int = 0
    worker_id: str = ""
    block_size: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_kv: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    max_num_seqs: int = 0
    deterministic: bool = False
    ngram: bool = False  # it speculates with ngram (takes Predicted Outputs)
    kv_address: str = ""  # where prefill workers send its KV (last report; "": none yet)
    num_reports: int = 0  # load reports taken in so far
    num_sent: int = 0  # requests sent by this router since the last report
    num_sent_blocks: int = 0
    full_until: float = 0.0  # refused for lack of room: skip until then

    @property
    def load(self) -> float:
        busy = self.num_running + self.num_waiting + self.num_waiting_for_kv + self.num_sent
        return busy / max(1, self.max_num_seqs)

    def has_room(self, num_blocks: int, now: float) -> bool:
        if now < self.full_until:
            return False
        seqs = self.num_running + self.num_waiting_for_kv + self.num_sent
        return (
            seqs < self.max_num_seqs and num_blocks <= self.num_free_blocks - self.num_sent_blocks
        )


@dataclass(frozen=True)
class ClusterStats:
    """What /metrics reports about the pools (the planner reads these)."""

    num_prefill_workers: int
    num_decode_workers: int
    prefill_queued_tokens: int
    decode_batch_occupancy: float
    decode_running: int
    decode_waiting: int
    decode_free_blocks: int
    decode_blocks: int


class WorkerPool:
    def __init__(
        self,
        poll_interval_s: float = 0.5,
        poll_timeout_s: float = 2.0,
        unhealthy_after: int = 2,
    ) -> None:
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s
        self.unhealthy_after = unhealthy_after
        self.prefill: dict[str, PrefillState] = {}
        self.decode: dict[str, DecodeState] = {}
        self._lock = threading.Lock()
        self._wanted: tuple[dict[str, str], dict[str, str]] | None = None
        self._task: asyncio.Task[None] | None = None
        # Each worker process's engine counters as last reported, by worker id (a restarted
        # worker has a new id, so sums over this never go down; one small entry per process
        # ever seen): the router's /metrics sums them (router/worker_metrics.py).
        self.worker_stats: dict[str, worker_pb2.WorkerStats] = {}

    # -- membership (any thread) -----------------------------------------------------------------

    def set_workers(self, prefill: dict[str, str], decode: dict[str, str]) -> None:
        """The workers that exist now: name -> gRPC address. Applied by the poll loop."""
        with self._lock:
            self._wanted = (dict(prefill), dict(decode))

    async def start(self) -> None:
        self._task = asyncio.create_task(self._poll_loop(), name="duet-worker-pool")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for p in self.prefill.values():
            await p.client.close()
        for d in self.decode.values():
            await d.client.close()
        self.prefill.clear()
        self.decode.clear()

    async def wait_until_ready(self, timeout_s: float) -> bool:
        """Until at least one decode worker is healthy (or `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.healthy_decode():
                return True
            await asyncio.sleep(0.05)
        return bool(self.healthy_decode())

    # -- polling -----------------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        while True:
            await self._apply_membership()
            await asyncio.gather(
                *(self._poll_prefill(s) for s in list(self.prefill.values())),
                *(self._poll_decode(s) for s in list(self.decode.values())),
            )
            await asyncio.sleep(self.poll_interval_s)

    async def _apply_membership(self) -> None:
        with self._lock:
            wanted, self._wanted = self._wanted, None
        if wanted is None:
            return
        prefill, decode = wanted
        for name in [n for n, s in self.prefill.items() if prefill.get(n) != s.client.address]:
            await self.prefill.pop(name).client.close()
        for name in [n for n, s in self.decode.items() if decode.get(n) != s.client.address]:
            await self.decode.pop(name).client.close()
        for name, address in prefill.items():
            self.prefill.setdefault(name, PrefillState(name, PrefillClient(address)))
        for name, address in decode.items():
            self.decode.setdefault(name, DecodeState(name, DecodeClient(address)))
        logger.info(
            "workers: prefill %s, decode %s", sorted(self.prefill), sorted(self.decode)
        )  # fmt: skip

    async def _poll_prefill(self, state: PrefillState) -> None:
        try:
            report = await state.client.load(state.last_event, self.poll_timeout_s)
        except (TimeoutError, grpc.aio.AioRpcError) as e:
            self._failed(state, e)
            return
        if report.worker_id != state.worker_id:  # new or restarted: its cache starts over
            state.worker_id, state.cached, state.num_sent_tokens = report.worker_id, set(), 0
        if report.snapshot:
            state.cached = set(report.stored_hashes)
        else:
            state.cached.update(report.stored_hashes)
            state.cached.difference_update(report.removed_hashes)
        state.last_event = report.last_event
        state.block_size = report.block_size
        state.num_queued_tokens = report.num_queued_tokens
        state.num_free_blocks = report.num_free_blocks
        state.num_blocks = report.num_blocks
        state.deterministic = report.deterministic
        if report.HasField("stats"):
            self.worker_stats[report.worker_id] = report.stats
        self._recovered(state)

    async def _poll_decode(self, state: DecodeState) -> None:
        try:
            report = await state.client.load(self.poll_timeout_s)
        except (TimeoutError, grpc.aio.AioRpcError) as e:
            self._failed(state, e)
            return
        state.worker_id = report.worker_id
        state.block_size = report.block_size
        state.num_running = report.num_running
        state.num_waiting = report.num_waiting
        state.num_waiting_for_kv = report.num_waiting_for_kv
        state.num_free_blocks = report.num_free_blocks
        state.num_blocks = report.num_blocks
        state.max_num_seqs = report.max_num_seqs
        state.deterministic = report.deterministic
        state.ngram = report.ngram
        state.kv_address = report.kv_address
        state.num_reports += 1
        state.num_sent = state.num_sent_blocks = 0  # the report includes them now
        if report.HasField("stats"):
            self.worker_stats[report.worker_id] = report.stats
        self._recovered(state)

    def _failed(self, state: PrefillState | DecodeState, error: BaseException) -> None:
        state.failures += 1
        if state.healthy and state.failures >= self.unhealthy_after:
            logger.warning("worker %s is unhealthy: %s", state.name, _reason(error))
            state.healthy = False

    @staticmethod
    def _recovered(state: PrefillState | DecodeState) -> None:
        if not state.healthy:
            logger.info("worker %s is healthy", state.name)
        state.healthy, state.failures = True, 0

    def mark_broken(self, state: PrefillState | DecodeState, reason: str) -> None:
        """A request found the worker unreachable: no new requests until a poll succeeds."""
        if state.healthy:
            logger.warning("worker %s unreachable: %s", state.name, reason)
        state.healthy = False

    # -- what this router sent and the workers have not reported yet -------------------------

    @staticmethod
    @contextmanager
    def sending_to_decode(state: DecodeState, num_blocks: int) -> Iterator[None]:
        """Count a request (a sequence slot and `num_blocks`) on `state` while it runs there
        and no load report includes it: the count comes off when the request ends first, and
        a report (which counts what the worker holds) resets it."""
        report = state.num_reports
        state.num_sent += 1
        state.num_sent_blocks += num_blocks
        try:
            yield
        finally:
            if state.num_reports == report:
                state.num_sent = max(0, state.num_sent - 1)
                state.num_sent_blocks = max(0, state.num_sent_blocks - num_blocks)

    @staticmethod
    @contextmanager
    def sending_to_prefill(state: PrefillState, num_tokens: int) -> Iterator[None]:
        """Count `num_tokens` uncached prompt tokens in `state`'s queue until its call ends
        (its reports count only what reached its scheduler; a restarted worker starts over)."""
        worker_id = state.worker_id
        state.num_sent_tokens += num_tokens
        try:
            yield
        finally:
            if state.worker_id == worker_id:
                state.num_sent_tokens = max(0, state.num_sent_tokens - num_tokens)

    # -- routing ---------------------------------------------------------------------------------

    def healthy_prefill(self) -> list[PrefillState]:
        return [s for s in self.prefill.values() if s.healthy]

    def healthy_decode(self) -> list[DecodeState]:
        return [s for s in self.decode.values() if s.healthy]

    def pick_prefill(
        self, prompt_token_ids: list[int], exclude: Iterable[str] = (), salt: str | None = None
    ) -> tuple[PrefillState, int] | None:
        """The prefill worker for a prompt and how many of its tokens it has cached (under
        the request's `cache_salt`, as the workers hash it)."""
        excluded = set(exclude)
        candidates = [s for s in self.healthy_prefill() if s.name not in excluded]
        if not candidates:
            return None
        hashes_by_size: dict[int, list[BlockHash]] = {}
        best: tuple[int, int, PrefillState] | None = None
        for state in candidates:
            size = state.block_size or 1
            if size not in hashes_by_size:
                hashes_by_size[size] = hash_request_blocks(prompt_token_ids, size, [], salt)
            hits = 0
            # The engine leaves at least one token to compute, so its hits stop one short.
            for block_hash in hashes_by_size[size][: (len(prompt_token_ids) - 1) // size]:
                if block_hash not in state.cached:
                    break
                hits += 1
            key = (hits * size, -state.queued_tokens)
            if best is None or key > best[:2]:
                best = (*key, state)
        assert best is not None
        return best[2], best[0]

    def pick_decode(
        self, num_prompt_tokens: int, exclude: Iterable[str] = ()
    ) -> DecodeState | None:
        excluded = set(exclude)
        now = time.monotonic()
        healthy = [s for s in self.healthy_decode() if s.name not in excluded]
        if not healthy:
            return None
        fits = [
            s for s in healthy if s.has_room(-(-num_prompt_tokens // max(1, s.block_size)), now)
        ]
        # Without room anywhere, try the least loaded: it may have freed blocks since its report.
        return min(fits or healthy, key=lambda s: (s.load, -s.num_free_blocks))

    def stats(self) -> ClusterStats:
        prefill = self.healthy_prefill()
        decode = self.healthy_decode()
        capacity = sum(s.max_num_seqs for s in decode)
        running = sum(s.num_running + s.num_waiting_for_kv for s in decode)
        return ClusterStats(
            num_prefill_workers=len(prefill),
            num_decode_workers=len(decode),
            prefill_queued_tokens=sum(s.queued_tokens for s in prefill),
            decode_batch_occupancy=running / capacity if capacity else 0.0,
            decode_running=sum(s.num_running for s in decode),
            decode_waiting=sum(s.num_waiting + s.num_waiting_for_kv for s in decode),
            decode_free_blocks=sum(s.num_free_blocks for s in decode),
            decode_blocks=sum(s.num_blocks for s in decode),
        )


def _reason(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return repr(error)
