"""OpenAI request fields duet does not implement, so none is silently ignored: each is accepted,
and when its value asks for something (not absent, null, empty, or OpenAI's own default) it is
logged as a warning and named in the response's `duet-ignored-fields` header, as vLLM does.
Fields that are not OpenAI's (nor vLLM's or duet's extras) are ignored with a warning naming
them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

logger = logging.getLogger(__name__)


def _absent(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


# Field -> whether its value asks for nothing. The order is the header's order.
_IGNORED: dict[str, Callable[[Any], bool]] = {
    "functions": _empty,
    "function_call": lambda v: v in (None, "none", "auto"),
    "audio": _absent,
    "modalities": lambda v: v in (None, [], ["text"]),
    "verbosity": _absent,
    "web_search_options": _absent,
    "service_tier": lambda v: v in (None, "auto", "default"),
    "store": lambda v: v in (None, False),
    "metadata": _empty,
    "moderation": _absent,
    "prompt_cache_options": _empty,
    "prompt_cache_retention": _absent,
}

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class PredictionTextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the reply is expected to follow mostly."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["content"]
    content: str | list[PredictionTextPart]

    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text for p in c)


class UnsupportedChatFields(BaseModel):
    """OpenAI chat-completion fields duet accepts without implementing (see `_IGNORED`), and
    `reasoning_effort`, which reaches chat templates that read it."""

    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Prediction | None = None
    """Predicted Outputs: with ngram speculation, proposals are also looked up in its tokens
    (`SamplingParams.prediction_token_ids`); named ignored on an engine that does not."""
    reasoning_effort: ReasoningEffort | None = None
    """The chat-template variable `reasoning_effort` (ignored, and named in the header, when
    the template does not read it)."""
    verbosity: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_key: str | None = None
    """Accepted: duet caches prompt prefixes on its own (a hint changes no output)."""
    safety_identifier: str | None = None
    """Accepted, like `user`: an identifier for the caller's own records."""

    def ignored(self) -> list[str]:
        """The fields this request sets that duet does not honour (logged here)."""
        return ignored_fields(self, _IGNORED, "POST /v1/chat/completions")


Inert = Callable[[Any], bool]
"""Whether a field's value asks for nothing (absent, null, empty, or OpenAI's default)."""

IGNORED_FIELDS_HEADER = "duet-ignored-fields"
"""The response header naming the request's fields duet accepted without honouring them."""


def ignored_fields(body: BaseModel, table: dict[str, Inert], where: str) -> list[str]:
    """The fields of `body` in `table` whose value asks for something duet does not do: logged
    as a warning, and named by the caller in the `duet-ignored-fields` header."""
    names = [name for name, inert in table.items() if not inert(getattr(body, name))]
    log_ignored(where, names)
    return names


def log_ignored(where: str, names: list[str]) -> None:
    """The warning that names fields a request set and duet does not honour (none: nothing)."""
    if names:
        logger.warning("%s: ignoring fields duet does not implement: %s", where, names)


def warn_unknown_fields(model: type[BaseModel], data: Any) -> None:
    """Log, by name, the fields of a request body that `model` does not know (ignored)."""
    if isinstance(data, dict):
        unknown = sorted(set(data) - set(model.model_fields))
        if unknown:
            logger.warning("%s: ignoring fields that are not OpenAI's: %s", model.__name__, unknown)
