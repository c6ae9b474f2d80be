"""`Scheduler`: phase-less, token-budget continuous batching.

Each step, every scheduled request's `num_computed_tokens` moves toward its `num_tokens`
within `max_num_batched_tokens`: a long prompt is prefilled in chunks over several steps,
side by side with one-token decodes. Running requests go first (oldest first); waiting ones
are admitted while budget, sequence slots and KV blocks last. When a running request cannot
grow, the lowest-priority running request is preempted: its blocks are freed and it
recomputes later (its prefix may still be cached).

Disaggregation adds two side doors. On a decode worker, `add_remote_request` reserves blocks
for a prompt whose KV is computed elsewhere (WAITING_FOR_REMOTE_KV: never scheduled, counted
against `max_num_seqs`), and `complete_remote` makes it RUNNING once the KV and the first token
arrived. On a prefill worker, a `prefill_only` request finishes (FINISHED_REMOTE) right after
its first token but keeps its blocks, "held" for the KV transfer, until `release_held`.

Only the engine's thread calls into the scheduler.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from duet.engine.config import EngineConfig
from duet.engine.kv_cache_manager import KVCacheManager
from duet.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num_new_tokens)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Proposed tokens scheduled after each speculating request's last token (they are part of
    # its `num_new_tokens`).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival) for the priority policy."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._fifo) + len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._fifo) if self.policy == "fcfs" else (e[-1] for e in sorted(self._heap))

    def push(self, request: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            (self._fifo.appendleft if front else self._fifo.append)(request)
        else:
            heapq.heappush(self._heap, (*request.sort_key(), next(self._counter), request))

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][-1]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.remove(request)
        else:
            self._heap = [e for e in self._heap if e[-1] is not request]
            heapq.heapify(self._heap)


class Scheduler:
    def __init__(
        self, config: EngineConfig, kv_cache_manager: KVCacheManager, max_model_len: int
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.waiting_for_kv: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # FINISHED_REMOTE, blocks kept for the transfer
        self._left_running: list[str] = []  # ids that left `running` since the last take
        self._trimmed: dict[str, int] = {}  # id -> blocks kept, after rejected guesses
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv)

    @property
    def num_seq_slots_used(self) -> int:
        """Sequences counted against `max_num_seqs`: running, and reserved for remote KV."""
        return len(self.running) + len(self.waiting_for_kv)

    def has_schedulable_requests(self) -> bool:
        """True when `schedule` could run something now (not only remote-KV waits)."""
        return bool(self.waiting) or bool(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished > 0

    def take_left_running(self) -> list[str]:
        """Ids of requests that left the running set (finished, aborted, preempted) since the
        last call: the model runner frees their input-batch slots."""
        left, self._left_running = self._left_running, []
        return left

    def take_trimmed(self) -> dict[str, int]:
        """Running requests whose block tables lost their tail since the last call (blocks
        taken for rejected guesses), with how many blocks each kept: the model runner must
        rewrite those rows from there, since the next blocks may have other ids."""
        trimmed, self._trimmed = self._trimmed, {}
        return trimmed

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            # Proposed tokens are tokens to compute like any other, within the budget; only
            # a request about to decode speculates.
            spec, request.spec_token_ids = request.spec_token_ids, []
            if num_new == 1 and budget > 1:
                spec = spec[: budget - 1]
                num_new += len(spec)
            else:
                spec = []
            if num_new <= 0:
                i += 1
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                if spec:  # drop the guesses before preempting anyone for them
                    num_new -= len(spec)
                    spec = []
                    continue
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1  # an already-scheduled request left the list before us
                budget += self._preempt(victim, out)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted itself; running[i] is now the next request
            out.scheduled.append((request, num_new))
            if spec:
                out.spec_token_ids[request.request_id] = spec
            budget -= num_new
            i += 1

        # New requests are admitted only when nothing had to be preempted this step.
        while not out.preempted and self.waiting and budget > 0:
            if self.num_seq_slots_used >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            computed, num_hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            if self.kv.allocate_slots(request, num_new, computed) is None:
                break
            self.waiting.pop()
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new

        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[tuple[Request, int]]:
        """Advance computed counts, append sampled tokens, finish what stopped.

        `sampled`: each request's new tokens: one, or with speculation the accepted proposed
        tokens plus the target's own next one. A proposed token that was rejected leaves
        `num_computed_tokens` behind its KV slot (recomputed next step) and the blocks taken
        only for such tokens go back to the pool; tokens past a stop are dropped.
        Returns (request, number of tokens appended) for requests that got any."""
        updated = []
        for request, num_new in out.scheduled:
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += num_new
            tokens = sampled.get(request.request_id)
            if tokens is None:  # a prefill chunk short of the end: nothing sampled yet
                self.kv.cache_blocks(request, request.num_computed_tokens)
                continue
            spec = out.spec_token_ids.get(request.request_id)
            if spec:
                # Accepted guesses' KV is valid; the first rejected one's and after are not.
                request.num_computed_tokens -= len(spec) + 1 - len(tokens)
            status = None
            num_appended = 0
            for token in tokens:
                request.append_output_token(token)
                num_appended += 1
                status = self._check_stop(request, token)
                if status is not None:
                    break
            # NOTE: cached after appending (accepted tokens are now in `all_token_ids`) and
            # never past `num_computed_tokens`: a rejected guess never reaches the cache.
            self.kv.cache_blocks(request, request.num_computed_tokens)
            if status is not None:
                self.finish_request(request, status)
            elif spec and self.kv.trim(request, request.num_tokens):
                self._trimmed[request.request_id] = len(self.kv.req_to_blocks[request.request_id])
            updated.append((request, num_appended))
        return updated

    def _append_token(self, request: Request, token: int) -> None:
        request.append_output_token(token)
        status = self._check_stop(request, token)
        if status is not None:
            self.finish_request(request, status)

    # -- disaggregation ------------------------------------------------------------------------

    def can_add_remote_request(self, num_prompt_tokens: int) -> bool:
        return (
            self.num_seq_slots_used < self.config.max_num_seqs
            and self.kv.num_blocks_for(num_prompt_tokens) <= self.kv.num_free_blocks
        )

    def add_remote_request(self, request: Request) -> list[int] | None:
        """Reserve blocks for the prompt's KV, computed elsewhere. Returns the block ids to
        receive into, or None (nothing changed) when there is no sequence slot or room."""
        if not self.can_add_remote_request(request.num_prompt_tokens):
            return None
        # NOTE: fresh blocks, never prefix-cache hits: the transfer writes into them.
        if self.kv.allocate_slots(request, request.num_prompt_tokens) is None:
            return None
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_cached_tokens = 0
        self.requests[request.request_id] = request
        self.waiting_for_kv[request.request_id] = request
        return self.kv.get_block_ids(request.request_id)

    def complete_remote(self, request_id: str, first_token: int) -> Request | None:
        """The prompt's KV is in the reserved blocks and `first_token` was sampled by the
        prefill worker: the request runs from the next step (or finishes right here, when the
        first token already stops it). None when the request is no longer waiting."""
        request = self.waiting_for_kv.pop(request_id, None)
        if request is None:
            return None
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._append_token(request, first_token)
        return request

    def release_held(self, request_id: str) -> bool:
        """Free the blocks of a FINISHED_REMOTE request (its transfer ended). Full blocks stay
        in the prefix cache. False when nothing was held under that id."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.kv.free(request)
        return True

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End a request (stop, length, abort or remote) and free its blocks, except a
        FINISHED_REMOTE request's, which are held until `release_held`. Idempotent."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._left_running.append(request.request_id)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_kv[request.request_id]
        else:
            self.waiting.remove(request)
        request.status = status
        self.requests.pop(request.request_id, None)
        if status == RequestStatus.FINISHED_REMOTE:
            self.held[request.request_id] = request
        else:
            self.kv.free(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        if request.prefill_only:
            return RequestStatus.FINISHED_REMOTE  # every stop rule is applied by the decode side
        params = request.sampling_params
        if request.grammar is not None:
            if request.grammar.rejected:
                logger.error(
                    "request %s: token %d is outside its grammar", request.request_id, token
                )
                return RequestStatus.FINISHED_ABORTED
            if request.grammar.is_terminated:  # complete, and its EOS taken
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=Request.sort_key)
        return self.running[-1]

    def _preempt(self, victim: Request, out: SchedulerOutput) -> int:
        """Free the victim's blocks and send it back to waiting. Returns budget it gives back."""
        refund = 0
        for j, (req, num_new) in enumerate(out.scheduled):
            if req is victim:
                del out.scheduled[j]
                refund = num_new
                break
        out.spec_token_ids.pop(victim.request_id, None)
        victim.spec_token_ids = []
        self.running.remove(victim)
        self._left_running.append(victim.request_id)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(victim, front=True)
        out.preempted.append(victim)
        return refund
