"""OpenAI request fields duet does not implement, so none is silently ignored: each is accepted
only with a value that asks for nothing (absent, null, empty, or OpenAI's own default), and is
otherwise a 400 naming the field. Fields that are not OpenAI's (nor vLLM's or duet's extras) are
ignored with a warning naming them, as vLLM does."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationInfo, field_validator

logger = logging.getLogger(__name__)


def _absent(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


# Field -> whether its value asks for nothing. The order is the check order.
_INERT: dict[str, Callable[[Any], bool]] = {
    "functions": _empty,
    "function_call": lambda v: v in (None, "none", "auto"),
    "audio": _absent,
    "modalities": lambda v: v in (None, [], ["text"]),
    "prediction": _absent,
    "reasoning_effort": _absent,
    "verbosity": _absent,
    "web_search_options": _absent,
    "service_tier": lambda v: v in (None, "auto", "default"),
    "store": lambda v: v in (None, False),
    "metadata": _empty,  # only kept with store
}


class UnsupportedChatFields(BaseModel):
    """OpenAI chat-completion fields duet does not implement (see `_INERT`)."""

    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None
    prompt_cache_key: str | None = None
    """Accepted: duet caches prompt prefixes on its own (a hint changes no output)."""
    safety_identifier: str | None = None
    """Accepted, like `user`: an identifier for the caller's own records."""

    @field_validator(*_INERT)
    @classmethod
    def _refuse_what_asks_for_something(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        if not _INERT[info.field_name](value):
            raise ValueError(
                "is not supported by this server (docs/serving.md lists the fields it implements)"
            )
        return value


Inert = Callable[[Any], bool]
"""Whether a field's value asks for nothing (absent, null, empty, or OpenAI's default)."""

IGNORED_FIELDS_HEADER = "duet-ignored-fields"
"""The response header naming the request's fields duet accepted without honouring them."""


def ignored_fields(body: BaseModel, table: dict[str, Inert], where: str) -> list[str]:
    """The fields of `body` in `table` whose value asks for something duet does not do: logged
    as a warning, and named by the caller in the `duet-ignored-fields` header."""
    names = [name for name, inert in table.items() if not inert(getattr(body, name))]
    if names:
        logger.warning("%s: ignoring fields duet does not implement: %s", where, names)
    return names


def warn_unknown_fields(model: type[BaseModel], data: Any) -> None:
    """Log, by name, the fields of a request body that `model` does not know (ignored)."""
    if isinstance(data, dict):
        unknown = sorted(set(data) - set(model.model_fields))
        if unknown:
            logger.warning("%s: ignoring fields that are not OpenAI's: %s", model.__name__, unknown)
