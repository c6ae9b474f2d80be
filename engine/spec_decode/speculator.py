"""`Speculator`: the engine's side of speculative decoding. After each step it asks the
proposer for the next tokens of the requests that will decode (each capped so no guess runs
past `max_tokens` or the context), backs off per request while guesses keep failing, and
counts what was proposed and accepted (`SpecDecodeStats`, exported by `/metrics`).

Adaptive (`adaptive`, on by default), per request:
- Lookahead: a request proposes up to its own k, from min(2, `num_speculative_tokens`) up to it. It
  starts at the maximum; a verification that accepts every guess doubles it, one that rejects a
  guess sets it to the accepted run plus one (at least 2). Copying runs grow to the maximum,
  while scattered guesses cost a row or two each. Simulated on the benchmark's recorded greedy
  outputs (docs/speculative_decoding.md), this matches a fixed k where verification rows are
  cheap and beats it where they are not.
- Back-off: a request whose moving acceptance rate (accepted / proposed, halved weight per
  verification) drops below `min_acceptance_rate` proposes nothing for a pause of 1, 2, 4, ...
  up to `max_backoff_steps` decode steps, then probes once; a probe that pays resets the pause.
  A guess that fails costs a verification row per proposed token, so on a workload where
  nothing matches speculation decays to a probe every `max_backoff_steps` steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from duet.engine.request import Request
from duet.engine.spec_decode.config import SpeculativeConfig
from duet.engine.spec_decode.factory import create_proposer
from duet.engine.spec_decode.proposer import ProposeContext, TargetInfo

CPU_BATCH_LIMIT = 4
"""`disable_by_batch_size` on a CPU when unset: on a 2-core EPYC (SmolLM2, bf16, ngram k=4)
speculation gave 1.76x/1.31x at batch 1 (copy/chat), 1.11x/0.98x at 4, 0.94x/0.87x at 16."""


@dataclass
class SpecDecodeStats:
    """Counters since the engine started (vLLM's `spec_decode_*`)."""

    num_drafts: int = 0  # verifications: request-steps that computed at least one guess
    num_draft_tokens: int = 0  # proposed tokens verified
    num_accepted_tokens: int = 0  # of which accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k]
    num_backoffs: int = 0  # times a request paused its speculation

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class _Backoff:
    k: int  # most guesses the request's next proposal may hold
    rate: float | None = None  # moving acceptance rate
    pause: int = 0  # length of the current (or last) pause, steps
    skip: int = 0  # steps left in the pause


class Speculator:
    """Engine thread only."""

    def __init__(self, config: SpeculativeConfig, target: TargetInfo) -> None:
        self.config = config
        self.max_model_len = target.max_model_len
        self.proposer = create_proposer(config, target)
        limit = config.disable_by_batch_size
        if limit is None and target.device.type == "cpu":
            limit = CPU_BATCH_LIMIT
        self.max_batch = limit
        """Most decoding requests a step may have for proposals to be made (None: any)."""
        self.stats = SpecDecodeStats(
            num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens
        )
        self._backoff: dict[str, _Backoff] = {}

    def propose(self, requests: Iterable[Request]) -> None:
        """Set `spec_token_ids` of the requests that decode next (running, one token to
        compute), for the scheduler's next step."""
        chosen: list[Request] = []
        caps: list[int] = []
        num_decoding = 0
        for request in requests:
            request.spec_token_ids = []
            if (
                request.is_finished
                or request.prefill_only
                or request.num_tokens - request.num_computed_tokens != 1
            ):
                continue
            num_decoding += 1
            # A step turns k guesses into up to k + 1 tokens: stop short of max_tokens and
            # keep every guessed position inside the context.
            cap = min(
                self.lookahead(request.request_id),
                request.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            )
            if cap <= 0 or self._paused(request.request_id):
                continue
            chosen.append(request)
            caps.append(cap)
        if not chosen or (self.max_batch is not None and num_decoding > self.max_batch):
            for request in chosen:
                request.spec_token_ids = []
            return
        for request, proposal in zip(
            chosen, self.proposer.propose(ProposeContext(chosen, caps)), strict=True
        ):
            if proposal.probs is not None:
                # NOTE: the runner verifies point masses only; a distribution would be ignored
                # and the output's distribution silently wrong.
                raise NotImplementedError(
                    f"{self.proposer.method}: proposals with a distribution are not verified yet"
                )
            tokens = proposal.token_ids
            if request.grammar is not None:  # structured outputs: only guesses it allows
                tokens = tokens[: request.grammar.valid_prefix(tokens)]
            request.spec_token_ids = tokens

    def verified(self, proposed: Mapping[str, list[int]], sampled: Mapping[str, list[int]]) -> None:
        """A step's verifications: each request's proposed tokens and its new tokens."""
        for request_id, spec in proposed.items():
            tokens = sampled.get(request_id)
            if spec and tokens is not None:
                self.observe(request_id, len(spec), len(tokens) - 1)

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """A verification of `num_proposed` guesses kept the first `num_accepted`."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_proposed
        s.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            s.num_accepted_tokens_per_pos[pos] += 1
        if not self.config.adaptive:
            return
        k_max = self.config.num_speculative_tokens
        state = self._backoff.setdefault(request_id, _Backoff(k_max))
        if num_accepted == num_proposed:
            state.k = min(k_max, 2 * state.k)
        else:
            state.k = min(k_max, max(2, num_accepted + 1))
        rate = num_accepted / num_proposed
        state.rate = rate if state.rate is None else (state.rate + rate) / 2
        if state.rate < self.config.min_acceptance_rate:
            state.pause = min(self.config.max_backoff_steps, max(1, 2 * state.pause))
            state.skip = state.pause
            state.rate = None  # the probe after the pause decides afresh
            s.num_backoffs += 1
        else:
            state.pause = 0

    def lookahead(self, request_id: str) -> int:
        """Most guesses the request's next proposal may hold."""
        state = self._backoff.get(request_id)
        return self.config.num_speculative_tokens if state is None else state.k

    def release(self, request_id: str) -> None:
        """The request left the engine."""
        self._backoff.pop(request_id, None)
        self.proposer.release(request_id)

    def _paused(self, request_id: str) -> bool:
        state = self._backoff.get(request_id)
        if state is None or state.skip <= 0:
            return False
        state.skip -= 1
        return True
