"""`SamplingParams`: OpenAI's sampling knobs, validated on construction."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from duet.engine.errors import InvalidInputError
from duet.engine.structured_output import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Invalid values raise `InvalidInputError`."""

    n: int = 1
    """Completions per prompt."""
    max_tokens: int | None = 16
    """Most tokens to generate. None: up to the model's context length."""
    min_tokens: int = 0
    """Stop and EOS tokens are ignored until this many tokens are generated."""
    temperature: float = 1.0
    """0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's, in [0, 1]."""
    seed: int | None = None
    """Per-request generator seed: same seed, same output whatever else is in the batch."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; not included in the output."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (besides EOS)."""
    bad_words: list[str] = field(default_factory=list)
    """vLLM's: words the output never contains as tokenized: each word's tokens, with and
    without a leading space; a one-token word is never sampled, and the last token of a
    longer one not after the output's tokens match the rest of it."""
    ignore_eos: bool = False
    """Keep generating past EOS."""
    presence_penalty: float = 0.0
    """OpenAI presence penalty over generated tokens, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """OpenAI frequency penalty over generated tokens, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """HF-style multiplicative penalty over prompt and generated tokens, > 0."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives (0..20)."""
    prompt_logprobs: int | None = None
    """Return, for every prompt token after the first, its logprob and this many top
    alternatives (0..20), as vLLM does. Such a request skips the prefix cache (the logits of
    every prompt position are needed, so every position is computed)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    logit_bias: dict[int, float] | None = None
    """Token id -> a value in [-100, 100] added to its logit before sampling (after penalties,
    before the grammar mask and temperature), as OpenAI's `logit_bias`: -100 all but bans a
    token, 100 all but forces it. Logprobs stay the model's own. The ids must be in the model's
    vocabulary (checked where the request is admitted)."""
    allowed_token_ids: list[int] | None = None
    """vLLM's: only these token ids may be sampled (every other logit is -inf before the
    penalties, the bias and temperature); logprobs stay the model's own. Not empty; the ids
    must be in the model's vocabulary (checked where the request is admitted)."""
    prediction_token_ids: list[int] | None = None
    """OpenAI's Predicted Outputs, as token ids: text the output is expected to follow mostly
    (a file being edited). With ngram speculation the proposer also looks the output's last
    tokens up in these, as if they came before the prompt, so a stretch the output copies is
    proposed run after run. Speeds nothing up without ngram speculation; the output is the
    same with or without it. The ids must be in the model's vocabulary."""
    include_stop_str_in_output: bool = False
    """vLLM's: a stop string that ends the output stays at its end (by default it is cut)."""
    cache_salt: str | None = None
    """vLLM's: mixed into the prefix cache's hash of the prompt's first block, so only requests
    with the same salt share cached blocks (a tenant's own, where tenants must not learn of one
    another's prompts by their speed). Not empty."""
    structured_outputs: StructuredOutputsParams | None = None
    """A grammar the output must match (JSON schema, JSON object, regex, choice, EBNF); a dict
    is read as `StructuredOutputsParams` fields. See docs/structured_outputs.md."""
    pooling: str | None = None
    """An embedding request (`/v1/embeddings`): the prompt's final hidden states (after the
    model's last norm) pooled, `last` (the last token's, as vLLM pools decoder models),
    `mean` (every token's) or `cls` (the first token's), then scaled to unit length, come back as `RequestOutput.embedding`.
    It samples one token, which is not its answer: needs `max_tokens` 1 and `n` 1. With
    `mean` or `cls` it skips the prefix cache (positions before the last are needed)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        _int_min("n", self.n, 1)
        if self.max_tokens is not None:
            _int_min("max_tokens", self.max_tokens, 1)
        _int_min("min_tokens", self.min_tokens, 0)
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidInputError("temperature", f"must be >= 0; got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidInputError("top_p", f"must be in (0, 1]; got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise InvalidInputError(
                "top_k", f"must be -1 (disabled) or an integer >= 0; got {self.top_k!r}"
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidInputError("min_p", f"must be in [0, 1]; got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise InvalidInputError(name, f"must be in [-2, 2]; got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidInputError(
                "repetition_penalty", f"must be > 0; got {self.repetition_penalty!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 20
            ):
                raise InvalidInputError(name, f"must be an integer in [0, 20]; got {value!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            raise InvalidInputError("seed", f"must be an integer; got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidInputError("stop", "must be non-empty strings")
        if not isinstance(self.bad_words, list) or not all(
            isinstance(w, str) and w.strip() for w in self.bad_words
        ):
            raise InvalidInputError("bad_words", "must be a list of words (non-blank strings)")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise InvalidInputError("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias) or None  # {}: no bias
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_allowed_token_ids(self.allowed_token_ids)
        if self.prediction_token_ids is not None and not (
            isinstance(self.prediction_token_ids, list)
            and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.prediction_token_ids
            )
        ):
            raise InvalidInputError(
                "prediction_token_ids", "must be a list of token ids (integers >= 0)"
            )
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not self.cache_salt
        ):
            raise InvalidInputError(
                "cache_salt", f"must be a non-empty string; got {self.cache_salt!r}"
            )
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidInputError(
                "include_stop_str_in_output",
                f"must be a boolean; got {self.include_stop_str_in_output!r}",
            )
        if self.pooling is not None:
            if self.pooling not in POOLING_TYPES:
                raise InvalidInputError(
                    "pooling", f"must be one of {', '.join(POOLING_TYPES)}; got {self.pooling!r}"
                )
            if self.max_tokens != 1 or self.n != 1:
                raise InvalidInputError(
                    "pooling",
                    "needs max_tokens 1 and n 1 (an embedding samples nothing it returns)",
                )
        if self.min_tokens and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidInputError("min_tokens", f"must be <= max_tokens ({self.max_tokens})")

    def to_json(self) -> str:
        """Every field, as JSON: how the router hands a request's parameters to workers."""
        data = dataclasses.asdict(self)
        if self.structured_outputs is not None:
            data["structured_outputs"] = self.structured_outputs.to_dict()
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> SamplingParams:
        """Inverse of `to_json`, validated like the constructor; unknown keys are refused."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidInputError("sampling_params", f"is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise InvalidInputError("sampling_params", "must be a JSON object")
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise InvalidInputError(unknown[0], "is not a sampling parameter")
        if isinstance(data.get("logit_bias"), dict):  # JSON's keys are strings
            data["logit_bias"] = _int_keys(data["logit_bias"])
        return cls(**data)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )


POOLING_TYPES = ("last", "mean", "cls")
"""How an embedding request pools its prompt's hidden states."""

MAX_LOGIT_BIAS = 100.0
"""The largest bias magnitude (OpenAI's range is [-100, 100])."""


def _int_keys(bias: dict[object, object]) -> dict[object, object]:
    """`bias` with its keys read as integers (JSON's are strings)."""
    out: dict[object, object] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value  # type: ignore[call-overload]
        except (TypeError, ValueError):
            raise InvalidInputError(
                "logit_bias", f"keys must be token ids (integers); got {key!r}"
            ) from None
    return out


def _check_logit_bias(bias: object) -> dict[int, float]:
    """`bias` as token id -> float, or `InvalidInputError` naming the bad entry."""
    if not isinstance(bias, dict):
        raise InvalidInputError("logit_bias", "must be a map of token ids to numbers")
    out: dict[int, float] = {}
    for token, value in bias.items():
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise InvalidInputError(
                "logit_bias", f"keys must be token ids (integers >= 0); got {token!r}"
            )
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidInputError(
                "logit_bias",
                f"values must be numbers in [-100, 100]; got {value!r} for token {token}",
            )
        out[token] = float(value)
    return out


def _check_allowed_token_ids(ids: object) -> list[int]:
    """`ids` as distinct token ids in their first order, or `InvalidInputError`."""
    if not isinstance(ids, list | tuple) or not ids:
        raise InvalidInputError("allowed_token_ids", "must be a non-empty list of token ids")
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise InvalidInputError(
                "allowed_token_ids", f"must be token ids (integers >= 0); got {token!r}"
            )
    return list(dict.fromkeys(ids))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int_min(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidInputError(name, f"must be an integer >= {minimum}; got {value!r}")
