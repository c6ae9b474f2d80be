"""`SpeculativeConfig`: how an engine speculates, spelled as vLLM spells it
(`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, ...}`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NoReturn, Self

from duet.engine.errors import InvalidInputError

METHODS = ("ngram", "draft_model")
"""Proposal methods this engine knows; EAGLE and MTP heads are future ones."""

DRAFT_PREFILL = ("decode", "prefill", "auto")
"""Where a disaggregated deployment computes the draft model's KV over a prompt: on the decode
worker (its shadow catches up with the whole prompt at the first proposal), on the prefill
worker (alongside the target's, shipped in the same transfer), or by prompt length."""

DEFAULT_DRAFT_PREFILL = "decode"
DEFAULT_DRAFT_PREFILL_MIN_TOKENS = 256

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
    draft_prefill: str | None = None
    """draft_model, disaggregated: where the draft's prompt KV is computed (`DRAFT_PREFILL`;
    None: `DEFAULT_DRAFT_PREFILL`)."""
    draft_prefill_min_tokens: int | None = None
    """draft_prefill auto: prompts of at least this many tokens have the draft prefilled on
    the prefill worker, shorter ones on the decode worker (None:
    `DEFAULT_DRAFT_PREFILL_MIN_TOKENS`)."""

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
        else:
            for key in ("model", "draft_prefill", "draft_prefill_min_tokens"):
                if getattr(self, key) is not None:
                    _fail(key, f"applies to method draft_model only; got it with {self.method!r}")
        if self.draft_prefill is not None and self.draft_prefill not in DRAFT_PREFILL:
            _fail(
                "draft_prefill",
                f"must be one of {', '.join(DRAFT_PREFILL)}; got {self.draft_prefill!r}",
            )
        if self.draft_prefill_min_tokens is not None:
            _check_int("draft_prefill_min_tokens", self.draft_prefill_min_tokens, 1, 1 << 24)
            if self.draft_prefill_mode != "auto":
                _fail(
                    "draft_prefill_min_tokens",
                    f"applies to draft_prefill auto only; got it with {self.draft_prefill_mode!r}",
                )

    @property
    def draft_prefill_mode(self) -> str:
        """`draft_prefill`, or its default."""
        return self.draft_prefill or DEFAULT_DRAFT_PREFILL

    @property
    def drafts_on_prefill(self) -> bool:
        """Whether a prefill worker may compute the draft's prompt KV (draft_model, with
        draft_prefill prefill or auto): it loads the draft, and the KV channel carries the
        draft's layers."""
        return self.method == "draft_model" and self.draft_prefill_mode != "decode"

    def prefills_draft_remotely(self, num_prompt_tokens: int) -> bool:
        """Whether the prefill worker computes the draft's KV over a prompt of this length
        (both sides of a transfer decide alike: the prefill worker ships it, the decode
        worker reserves draft blocks for it)."""
        mode = self.draft_prefill_mode
        if self.method != "draft_model" or mode == "decode":
            return False
        if mode == "prefill":
            return True
        threshold = self.draft_prefill_min_tokens or DEFAULT_DRAFT_PREFILL_MIN_TOKENS
        return num_prompt_tokens >= threshold

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
