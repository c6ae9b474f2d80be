"""The engine thread's record of each user request: the engine `Request`s of its `n` samples,
how many of their tokens have left the engine, and prompt logprobs as chunks compute them.

A step turns each request that changed into one `EngineOutput` (token ids, raw logprobs,
engine-side finishes): no text. Text, stop strings and the user-facing `RequestOutput` are
`engine.output_processor.OutputAssembler`'s, run by whoever reads the request's stream (the
event loop of `AsyncEngine.generate` or of a decode worker's stream), not the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from duet.engine.outputs import EngineOutput, PromptLogprob, SampleDelta, TokenLogprob
from duet.engine.prefill_handoff import PrefillDone
from duet.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from duet.engine.kv_cache_manager import KVCacheManager
    from duet.engine.scheduler import Scheduler
    from duet.engine.spec_decode.speculator import Speculator
    from duet.engine.stats import EngineStats


@dataclass
class SampleState:
    """One of a request's `n` samples (one engine `Request`)."""

    index: int
    request: Request
    num_sent_tokens: int = 0
    logprobs: list[TokenLogprob | None] | None = None  # the unsent tokens', when asked
    finish_reason: str | None = None
    stop_reason: int | None = None
    sent_finish: bool = False


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob | None] | None = None
    """With `SamplingParams.prompt_logprobs`: filled position by position as chunks run (a
    preempted request's recomputation overwrites them with the same values)."""
    prompt_logprobs_sent: bool = False
    embedding: list[float] | None = None
    """An embedding request's pooled hidden state, once its prompt ran; sent once."""

    @classmethod
    def new(
        cls, request_id: str, prompt: str | None, ids: list[int], num_prompt_logprobs: int | None
    ) -> RequestState:
        state = cls(request_id, prompt, ids)
        if num_prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(ids)
        return state

    def add_sample(self, request: Request) -> SampleState:
        asked = request.sampling_params.logprobs is not None
        sample = SampleState(len(self.samples), request, logprobs=[] if asked else None)
        self.samples.append(sample)
        return sample

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def add_prompt_logprobs(self, first: int, entries: Sequence[PromptLogprob | None]) -> None:
        """Entries for prompt tokens `first`, `first + 1`, ... (see `ModelRunner`)."""
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            self.prompt_logprobs[first : first + len(entries)] = entries

    def take_output(self) -> EngineOutput:
        """What changed since the previous output: every sample's unsent tokens and finish."""
        deltas = []
        for s in self.samples:
            ids = s.request.output_token_ids[s.num_sent_tokens :]
            s.num_sent_tokens += len(ids)
            logprobs = None
            if s.logprobs is not None:
                logprobs, s.logprobs = s.logprobs, []
            finish = s.finish_reason if not s.sent_finish else None
            s.sent_finish = s.finish_reason is not None
            deltas.append(SampleDelta(s.index, ids, logprobs, finish, s.stop_reason))
        prompt_logprobs = None
        if (
            self.prompt_logprobs is not None
            and not self.prompt_logprobs_sent
            and all(e is not None for e in self.prompt_logprobs[1:])
        ):
            prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        embedding, self.embedding = self.embedding, None
        return EngineOutput(
            self.request_id,
            deltas,
            finished=self.finished,
            num_cached_tokens=max(0, self.samples[0].request.num_cached_tokens),
            prompt_logprobs=prompt_logprobs,
            embedding=embedding,
        )


class RequestTable:
    """The engine's user requests by id, which sample each engine request is, and what the
    current step changed. Finishing a sample here finishes it in the scheduler, releases its
    speculation and keeps the token count; `take_outputs` ends the step."""

    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVCacheManager,
        stats: EngineStats,
        speculator: Speculator | None,
    ) -> None:
        self.scheduler, self.kv, self.stats, self.speculator = scheduler, kv, stats, speculator
        self.states: dict[str, RequestState] = {}
        self._sample_of: dict[str, tuple[RequestState, int]] = {}  # engine request id ->
        self._changed: dict[str, RequestState] = {}
        self.prefilled: list[PrefillDone] = []  # prefill-only requests at their first token

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def __len__(self) -> int:
        return len(self.states)

    def add(self, state: RequestState) -> None:
        self.states[state.request_id] = state
        for sample in state.samples:
            self._sample_of[sample.request.request_id] = (state, sample.index)

    def sample_of(self, engine_request_id: str) -> tuple[RequestState, int] | None:
        return self._sample_of.get(engine_request_id)

    def add_prompt_logprobs(
        self, engine_request_id: str, first: int, entries: Sequence[PromptLogprob | None]
    ) -> None:
        entry = self._sample_of.get(engine_request_id)
        if entry is not None:
            entry[0].add_prompt_logprobs(first, entries)

    def add_embedding(self, engine_request_id: str, embedding: list[float]) -> None:
        entry = self._sample_of.get(engine_request_id)
        if entry is not None:
            entry[0].embedding = embedding
            self._changed[entry[0].request_id] = entry[0]

    def on_tokens(
        self, request: Request, num_new: int, logprobs: list[TokenLogprob] | None
    ) -> None:
        """Record the request's `num_new` newest tokens (and its finish) for the next output."""
        entry = self._sample_of.get(request.request_id)
        if entry is None:
            return
        state, index = entry
        self.stats.num_generated_tokens += num_new
        if request.status == RequestStatus.FINISHED_REMOTE:
            block_ids = self.kv.get_block_ids(request.request_id)
            first_logprob = logprobs[0] if logprobs else None
            self.prefilled.append(
                PrefillDone.of(request, block_ids, first_logprob, state.prompt_logprobs)
            )
            self._sample_of.pop(request.request_id, None)
            self.states.pop(state.request_id, None)
            return
        sample = state.samples[index]
        if sample.logprobs is not None:  # one entry per token, None where there is none
            given = logprobs[:num_new] if logprobs is not None else []
            sample.logprobs.extend([*given, *[None] * (num_new - len(given))])
        if request.is_finished:
            sample.finish_reason = request.status.finish_reason
            if isinstance(request.stop_reason, int):
                sample.stop_reason = request.stop_reason
            self._forget(request)
        self._changed[state.request_id] = state

    def take_outputs(self) -> list[EngineOutput]:
        """One output per request that changed since the last call; finished ones leave."""
        outputs = []
        for request_id, state in self._changed.items():
            outputs.append(state.take_output())
            if state.finished:
                self.states.pop(request_id, None)
        self._changed.clear()
        return outputs

    def abort(self, request_id: str) -> EngineOutput | None:
        """End every sample of the request; its final output (None when not running)."""
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        for sample in state.samples:
            self.scheduler.abort_request(sample.request.request_id)
            self._forget(sample.request)
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
        return state.take_output()

    def finish_stopped(self, request_id: str, index: int, num_tokens: int) -> None:
        """See `LLMEngine.finish_stopped`."""
        state = self.states.get(request_id)
        if state is None or state.samples[index].finish_reason is not None:
            return
        sample = state.samples[index]
        request = sample.request
        self.stats.num_generated_tokens -= max(0, request.num_output_tokens - num_tokens)
        request.truncate_output(num_tokens)
        sample.num_sent_tokens = min(sample.num_sent_tokens, num_tokens)
        self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        sample.finish_reason, sample.sent_finish = "stop", True
        self._forget(request)
        if state.finished:
            del self.states[request_id]

    def _forget(self, request: Request) -> None:
        self._sample_of.pop(request.request_id, None)
        if self.speculator is not None:
            self.speculator.release(request.request_id)
