"""`SpeculativeConfig`: how an engine speculates, spelled as vLLM spells it
(`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, ...}`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NoReturn, Self

from engine.errors import InvalidInputError

METHODS = ("ngram", "draft_model")
"""Proposal methods this engine knows; EAGLE and MTP heads are future ones."""

FIELD = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    """One engine's speculative decoding. Built from the user's dict by `from_dict`, which
    refuses unknown keys and bad values with an error naming them."""

    method: str = "ngram"
    """ngram (prompt lookup in the request's own tokens) or draft_model (a smaller model)."""
    num_speculative_tokens: int = 3
    """Most tokens proposed per request per step."""
    prompt_lookup_min: int = 2
    """ngram: shortest suffix of the sequence matched against its earlier tokens."""
    prompt_lookup_max: int = 5
    """ngram: longest suffix matched (longer matches are tried first)."""
    model: str | None = None
    """draft_model: the draft model's path (same tokenizer and vocabulary as the target)."""
    adaptive: bool = True
    """Back off per request while its recent acceptance is below `min_acceptance_rate`."""
    min_acceptance_rate: float = 0.2
    """adaptive: accepted / proposed (a moving average per request) below which it backs off."""
    max_backoff_steps: int = 64
    """adaptive: longest pause, in decode steps, between probes of a backed-off request."""
    disable_by_batch_size: int | None = None
    """No proposals in a step after which more than this many requests decode (vLLM's key):
    a verification row costs about a decode token, so at large batches speculation stops
    paying. None: 4 on a CPU (measured: docs/speculative_decoding.md), no limit on a GPU."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            _fail("method", f"must be one of {', '.join(METHODS)}; got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, 32)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, 1024)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, 1024)
        if not isinstance(self.adaptive, bool):
            _fail("adaptive", f"must be true or false; got {self.adaptive!r}")
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate < 1:
            _fail("min_acceptance_rate", f"must be a number in [0, 1); got {rate!r}")
        _check_int("max_backoff_steps", self.max_backoff_steps, 1, 1 << 20)
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, 1 << 20)
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                _fail("model", "is required with method draft_model (the draft model's path)")
        elif self.model is not None:
            _fail("model", f"applies to method draft_model only; got it with {self.method!r}")

    @classmethod
    def from_dict(cls, value: Any) -> Self:
        """The config of a user's dict (e.g. `--speculative-config`'s JSON)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidInputError(FIELD, f"must be a JSON object; got {value!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            _fail(unknown[0], f"is not a key; known keys are {', '.join(names)}")
        if "method" not in value:
            _fail("method", f"is required (one of {', '.join(METHODS)})")
        return cls(**value)


def _fail(key: str, message: str) -> NoReturn:
    raise InvalidInputError(FIELD, f"{key!r} {message}")


def _check_int(key: str, value: Any, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        _fail(key, f"must be an integer in [{low}, {high}]; got {value!r}")
