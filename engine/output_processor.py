"""Turns engine-side token updates into user-facing `RequestOutput`s: incremental text, stop
strings (cut from the text, never streamed), logprobs, and the grouping of `n` samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.outputs import CompletionOutput, Logprob, PromptLogprob, RequestOutput, TokenLogprobs
from engine.request import Request
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class SampleState:
    """One of a request's `n` samples (one engine `Request`)."""

    index: int
    request: Request
    detok: IncrementalDetokenizer
    text: str = ""  # text released to the user (stop-string safe)
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob | None] | None = None
    """With `SamplingParams.prompt_logprobs`: filled position by position as chunks run (a
    preempted request's recomputation overwrites them with the same values)."""
    prompt_logprobs_out: list[dict[int, Logprob] | None] | None = None  # built once, complete

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def new_sample(self, index: int, request: Request) -> SampleState:
        detok = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling_params.skip_special_tokens
        )
        logprobs: list[TokenLogprobs] | None = (
            [] if request.sampling_params.logprobs is not None else None
        )
        return SampleState(index, request, detok, logprobs=logprobs)

    def process_token(
        self,
        sample: SampleState,
        token_id: int,
        logprob: tuple[float, list[tuple[int, float]]] | None,
    ) -> bool:
        """Fold one new token into the sample. True when a stop string ended it."""
        params = sample.request.sampling_params
        sample.detok.add_token(token_id)
        if sample.logprobs is not None and logprob is not None:
            chosen, top = logprob
            tok = self.tokenizer.id_to_token
            sample.logprobs.append(
                TokenLogprobs(
                    Logprob(token_id, chosen, tok(token_id)),
                    [Logprob(t, lp, tok(t)) for t, lp in top],
                )
            )
        full = sample.detok.text
        if params.stop and sample.request.num_output_tokens > params.min_tokens - 1:
            # Only the tail can hold a stop string that this token completed.
            window_start = max(0, len(sample.text) - max(len(s) for s in params.stop))
            hit = _find_stop(full, params.stop, window_start)
            if hit is not None:
                pos, stop = hit
                sample.text = full[:pos]
                sample.stop_reason = stop
                return True
        # Hold back a tail that could still grow into a stop string.
        hold = max((len(s) - 1 for s in params.stop), default=0)
        sample.text = full[: max(0, len(full) - hold)]
        return False

    def finish(self, sample: SampleState, reason: str) -> None:
        sample.finish_reason = reason
        if reason != "stop" or sample.stop_reason is None or isinstance(sample.stop_reason, int):
            sample.text = sample.detok.text  # release the held-back tail
        if reason == "stop" and isinstance(sample.request.stop_reason, int):
            sample.stop_reason = sample.request.stop_reason

    def new_state(
        self, request_id: str, prompt: str | None, ids: list[int], num_prompt_logprobs: int | None
    ) -> RequestState:
        state = RequestState(request_id, prompt, ids)
        if num_prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(ids)
        return state

    def add_prompt_logprobs(
        self, state: RequestState, first: int, entries: Sequence[PromptLogprob | None]
    ) -> None:
        """Entries for prompt tokens `first`, `first + 1`, ... (see `ModelRunner`)."""
        if state.prompt_logprobs is not None and state.prompt_logprobs_out is None:
            state.prompt_logprobs[first : first + len(entries)] = entries

    def prompt_logprobs_of(self, state: RequestState) -> list[dict[int, Logprob] | None] | None:
        """vLLM's shape, once every prompt token after the first has its entry."""
        if state.prompt_logprobs_out is not None or state.prompt_logprobs is None:
            return state.prompt_logprobs_out
        if any(e is None for e in state.prompt_logprobs[1:]):
            return None
        tok = self.tokenizer.id_to_token
        out: list[dict[int, Logprob] | None] = [None]
        for token_id, entry in zip(
            state.prompt_token_ids[1:], state.prompt_logprobs[1:], strict=True
        ):
            assert entry is not None
            chosen, rank, top = entry
            d = {token_id: Logprob(token_id, chosen, tok(token_id), rank)}
            for m, (t, lp) in enumerate(top):
                d.setdefault(t, Logprob(t, lp, tok(t), m + 1))
            out.append(d)
        state.prompt_logprobs_out = out
        return out

    def make_output(self, state: RequestState, delta: bool = True) -> RequestOutput:
        outputs = []
        for s in state.samples:
            token_ids = s.request.output_token_ids
            out = CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=list(token_ids),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                delta_text=s.text[s.num_sent_chars :],
                delta_token_ids=list(token_ids[s.num_sent_tokens :]),
            )
            if delta:
                s.num_sent_chars = len(s.text)
                s.num_sent_tokens = len(token_ids)
            outputs.append(out)
        cached = max(0, state.samples[0].request.num_cached_tokens)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=state.finished,
            num_cached_tokens=cached,
            prompt_logprobs=self.prompt_logprobs_of(state),
        )


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best
