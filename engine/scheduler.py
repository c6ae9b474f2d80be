"""`Scheduler`: phase-less, token-budget continuous batching.

Each step, every scheduled request's `num_computed_tokens` moves toward its `num_tokens`
within `max_num_batched_tokens`: a long prompt is prefilled in chunks over several steps,
side by side with one-token decodes. Running requests go first (oldest first); waiting ones
are admitted while budget, sequence slots and KV blocks last. When a running request cannot
grow, the lowest-priority running request is preempted: its blocks are freed and it
recomputes later (its prefix may still be cached).

Only the engine's thread calls into the scheduler.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num_new_tokens)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

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
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished > 0

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
            if num_new <= 0:
                i += 1
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1  # an already-scheduled request left the list before us
                budget += self._preempt(victim, out)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted itself; running[i] is now the next request
            out.scheduled.append((request, num_new))
            budget -= num_new
            i += 1

        # New requests are admitted only when nothing had to be preempted this step.
        while not out.preempted and self.waiting and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
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

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish what stopped.
        Returns the requests that got a new token (finished ones included)."""
        updated = []
        for request, num_new in out.scheduled:
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += num_new
            self.kv.cache_blocks(request, request.num_computed_tokens)
            token = sampled.get(request.request_id)
            if token is None:
                continue  # a prefill chunk short of the end: nothing sampled yet
            request.append_output_token(token)
            status = self._check_stop(request, token)
            if status is not None:
                self.finish_request(request, status)
            updated.append(request)
        return updated

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort) and free its blocks. Idempotent."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
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
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(victim, front=True)
        out.preempted.append(victim)
        return refund
