"""`OutputAssembler`: turns a request's `EngineOutput`s (token ids from the engine thread)
into user-facing `RequestOutput`s: incremental text, stop strings (cut from the text, never
streamed), logprobs with their token strings, and the grouping of `n` samples.

It runs where the request's stream is read (an event loop), not on the engine thread, as
vLLM's output processor runs in its front-end process. A stop string found here ends the
sample for the reader at once; `take_stops` names the samples the engine must now finish
(`engine.commands.FinishStopped`), which also drops the tokens the engine made meanwhile.
`LLMEngine.step` runs one per request on its own thread and applies the stops before the
next step, so offline generation never runs past a stop string."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from duet.engine.outputs import (
    CompletionOutput,
    EngineOutput,
    Logprob,
    PromptLogprob,
    RequestOutput,
    SampleDelta,
    TokenLogprob,
    TokenLogprobs,
)
from duet.engine.sampling_params import SamplingParams
from duet.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _Sample:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # text released to the user (stop-string safe)
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OutputAssembler:
    """One request's outputs, from its engine outputs in order. Not thread-safe: one reader."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.tokenizer = tokenizer
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self._hold = max((len(s) - 1 for s in params.stop), default=0)
        self._longest_stop = max((len(s) for s in params.stop), default=0)
        self.samples = [
            _Sample(
                i,
                IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens),
                logprobs=[] if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.embedding: list[float] | None = None
        self._stops: list[tuple[int, int]] = []

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def add(self, out: EngineOutput) -> RequestOutput:
        """Fold one engine output in; returns the request's output (deltas since the last)."""
        for delta in out.samples:
            self.add_sample(delta)
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.set_prompt_logprobs(out.prompt_logprobs)
        if out.embedding is not None:
            self.embedding = out.embedding
        return self.output()

    def add_sample(self, delta: SampleDelta) -> None:
        """Fold one sample's new tokens (and engine-side finish) in."""
        sample = self.samples[delta.index]
        if sample.finish_reason is not None:
            return  # a stop string ended it here; the engine's later tokens are dropped
        for i, token in enumerate(delta.token_ids):
            logprobs = delta.logprobs
            logprob = logprobs[i] if logprobs is not None and i < len(logprobs) else None
            if self._add_token(sample, token, logprob):
                self._stops.append((sample.index, len(sample.token_ids)))
                return
        if delta.finish_reason is not None:
            self._finish(sample, delta.finish_reason, delta.stop_reason)

    def set_prompt_logprobs(self, entries: Sequence[PromptLogprob | None]) -> None:
        """The prompt's logprobs, once every token after the first has its entry."""
        if self.prompt_logprobs is None and all(e is not None for e in entries[1:]):
            self.prompt_logprobs = self._prompt_logprobs(entries)

    def take_stops(self) -> list[tuple[int, int]]:
        """(sample index, tokens kept) of each stop string found since the last call."""
        stops, self._stops = self._stops, []
        return stops

    def abort(self) -> RequestOutput:
        """The final output of a request ended from outside (its unfinished samples abort)."""
        for sample in self.samples:
            if sample.finish_reason is None:
                self._finish(sample, "abort", None)
        return self.output()

    def _add_token(self, sample: _Sample, token_id: int, logprob: TokenLogprob | None) -> bool:
        """Fold one new token into the sample. True when a stop string ended it."""
        params = self.params
        sample.token_ids.append(token_id)
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
        if params.stop and len(sample.token_ids) > params.min_tokens - 1:
            # Only the tail can hold a stop string that this token completed.
            window_start = max(0, len(sample.text) - self._longest_stop)
            hit = _find_stop(full, params.stop, window_start)
            if hit is not None:
                pos, stop = hit
                sample.text = full[: pos + len(stop) if params.include_stop_str_in_output else pos]
                sample.stop_reason = stop
                sample.finish_reason = "stop"
                return True
        # Hold back a tail that could still grow into a stop string.
        sample.text = full[: max(0, len(full) - self._hold)]
        return False

    def _finish(self, sample: _Sample, reason: str, stop_token: int | None) -> None:
        sample.finish_reason = reason
        sample.text = sample.detok.text  # release the held-back tail
        if reason == "stop" and stop_token is not None:
            sample.stop_reason = stop_token

    def _prompt_logprobs(
        self, entries: Sequence[PromptLogprob | None]
    ) -> list[dict[int, Logprob] | None]:
        """vLLM's shape: per prompt token after the first, the token and the top ones."""
        tok = self.tokenizer.id_to_token
        out: list[dict[int, Logprob] | None] = [None]
        for token_id, entry in zip(self.prompt_token_ids[1:], entries[1:], strict=True):
            assert entry is not None
            chosen, rank, top = entry
            d = {token_id: Logprob(token_id, chosen, tok(token_id), rank)}
            for m, (t, lp) in enumerate(top):
                d.setdefault(t, Logprob(t, lp, tok(t), m + 1))
            out.append(d)
        return out

    def output(self, delta: bool = True) -> RequestOutput:
        outputs = []
        for s in self.samples:
            out = CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=list(s.token_ids),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                delta_text=s.text[s.num_sent_chars :],
                delta_token_ids=s.token_ids[s.num_sent_tokens :],
            )
            if delta:
                s.num_sent_chars = len(s.text)
                s.num_sent_tokens = len(s.token_ids)
            outputs.append(out)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            embedding=self.embedding,
        )


class OfflineOutputs:
    """The assemblers of `LLMEngine.step`, which makes its outputs on its own thread: a stop
    string found in a step ends its sample (`finish_stopped`) before the next step."""

    def __init__(self) -> None:
        self._assemblers: dict[str, OutputAssembler] = {}

    def open(self, assembler: OutputAssembler) -> None:
        self._assemblers[assembler.request_id] = assembler

    def assemble(
        self, raw: list[EngineOutput], finish_stopped: Callable[[str, int, int], None]
    ) -> list[RequestOutput]:
        outputs = []
        for item in raw:
            assembler = self._assemblers.get(item.request_id)
            if assembler is None:
                continue
            out = assembler.add(item)
            for index, num_tokens in assembler.take_stops():
                finish_stopped(item.request_id, index, num_tokens)
            if out.finished:
                del self._assemblers[item.request_id]
            outputs.append(out)
        return outputs

    def abort(self, raw: EngineOutput | None) -> RequestOutput | None:
        """The final output of an aborted request (None when it was not running)."""
        assembler = self._assemblers.pop(raw.request_id, None) if raw is not None else None
        if raw is None or assembler is None:
            return None
        assembler.add(raw)
        return assembler.abort()


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best
