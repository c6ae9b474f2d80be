"""`Request`: one sequence's state as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from duet.engine.sampling_params import SamplingParams
from duet.engine.structured_output import GrammarState


class RequestStatus(enum.IntEnum):
    """Ordered: everything after PREEMPTED is finished (`status > PREEMPTED`)."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()  # decode side: blocks reserved, KV on its way
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_REMOTE = enum.auto()  # prefill side: first token sampled, decode continues elsewhere

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_REMOTE: "remote",
}


class Request:
    """A sequence to extend. Its `num_computed_tokens` catches up with `num_tokens` each step;
    when they meet, the step samples one more token."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        priority: int = 0,
        arrival_time: float | None = None,
        sample_seed: int = 0,
        prefill_only: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Keys this request's draws (engine.random): its seed, or one the engine picked.
        self.sample_seed = sample_seed
        # Prefill side of a disaggregated request: finish after the first token and keep the
        # blocks (the KV is shipped to a decode worker) until the engine is told to release.
        self.prefill_only = prefill_only

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = (
            -1
        )  # prompt tokens served from the prefix cache; -1 until scheduled
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []  # chained hashes of its full blocks, filled lazily
        self.logprobs: list[dict[int, float]] = []  # per output token: {token_id: logprob}
        # With structured outputs: where the output stands in its grammar (every appended
        # token advances it; the sampler masks the logits with what it allows next).
        self.grammar: GrammarState | None = None
        # Speculative decoding: tokens a proposer guessed for the next step. The scheduler
        # takes them into a step's budget (`SchedulerOutput.spec_token_ids`); they never enter
        # `all_token_ids` unless verification accepts them.
        self.spec_token_ids: list[int] = []
        # The prompt's last tokens that are this request's own earlier output (a continuation
        # on another worker): bad words see them as output.
        self.num_replayed = 0
        # `SamplingParams.bad_words` as token sequences (`bad_words_token_ids`).
        self.bad_words_token_ids: list[list[int]] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def banned_next(self, ahead: Sequence[int] = ()) -> list[int]:
        """The tokens its bad words forbid next, after its output (the replayed tokens and
        `ahead`, proposed tokens taken, included): each one-token word's, and the last token
        of each longer word whose other tokens end that output."""
        if not self.bad_words_token_ids:
            return []
        # Only the output's last tokens can match a word's head: read no more of it.
        longest = max(len(word) for word in self.bad_words_token_ids) - 1
        first = max(self.num_prompt_tokens - self.num_replayed, self.num_tokens - longest)
        past = [*self.all_token_ids[first:], *ahead][-longest:] if longest else []
        banned = []
        for word in self.bad_words_token_ids:
            *head, last = word
            if not head or (len(head) <= len(past) and past[len(past) - len(head) :] == head):
                banned.append(last)
        return banned

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first `num_output_tokens` (a stop string ended the
        request inside a step's accepted tokens). Only for a request that is finishing."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[self.num_tokens - drop :]

    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )
