"""What generation returns: `RequestOutput` holding one `CompletionOutput` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

PromptLogprob = tuple[float, int, list[tuple[int, float]]]
"""A prompt token's logprob, its rank (1 + how many tokens were more likely) and the top
alternatives [(token id, logprob)], as the model runner computes them."""
TokenLogprob = tuple[float, list[tuple[int, float]]]
"""A sampled token's logprob and the top alternatives [(token id, logprob)], as the model
runner computes them."""


@dataclass
class Logprob:
    """Log-probability of one token (from the model's raw logits), with its text."""

    token_id: int
    logprob: float
    token: str = ""
    rank: int | None = None  # 1 + how many tokens were more likely (prompt logprobs)


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and the top alternatives at that position."""

    sampled: Logprob
    top: list[Logprob] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One sample of a request (there are `n`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort; None while running
    stop_reason: int | str | None = None  # the stop string or token that ended it
    logprobs: list[TokenLogprobs] | None = None
    delta_text: str = ""  # text added since the previous streamed output
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Outputs of one prompt. `.text`, `.token_ids`, `.finish_reason`, `.logprobs` read the
    first sample; `.outputs` holds all `n`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With `SamplingParams.prompt_logprobs`: one entry per prompt token, None for the first;
    each maps the prompt token (first) and the top alternatives to their `Logprob` (vLLM's
    shape). Complete from the first output on."""
    embedding: list[float] | None = None
    """With `SamplingParams.pooling`: the prompt's pooled, unit-length hidden state (its
    sampled token is not part of the answer)."""

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs


# -- what leaves the engine thread ----------------------------------------------------------


@dataclass
class SampleDelta:
    """One sample's tokens since the engine's previous output for its request: ids only (no
    text; `engine.output_processor.OutputAssembler` makes the text off the engine thread)."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None  # one per token, when the request asked
    finish_reason: str | None = None  # stop (a stop token or EOS) | length | abort
    stop_reason: int | None = None  # the stop token that ended it


@dataclass
class EngineOutput:
    """One step's news of one request, as the engine thread hands it on: every sample's new
    token ids, raw logprobs and engine-side finish (length, stop tokens, abort). Stop strings
    are matched by whoever detokenizes; a hit comes back as `engine.commands.FinishStopped`."""

    request_id: str
    samples: list[SampleDelta]
    finished: bool = False  # every sample finished engine-side
    num_cached_tokens: int = 0
    prompt_logprobs: list[PromptLogprob | None] | None = None  # once, when all are computed
    embedding: list[float] | None = None  # an embedding request's, once its prompt ran
