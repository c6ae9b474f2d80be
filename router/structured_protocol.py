"""REST bodies for structured outputs: OpenAI's `response_format` (chat) and vLLM's
`structured_outputs` extra (chat and completions), turned into the engine's
`StructuredOutputsParams` (docs/structured_outputs.md)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from duet.engine import InvalidInputError, StructuredOutputsParams


class _Body(BaseModel):
    # NOTE: `json` and `schema` are BaseModel methods, so those fields go by alias.
    model_config = ConfigDict(
        extra="forbid", allow_inf_nan=False, populate_by_name=True, strict=True
    )


class JsonSchemaSpec(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """The JSON schema the reply is an instance of; none: any JSON object."""
    strict: bool | None = None
    """Accepted either way: the grammar always enforces the schema exactly."""


class ResponseFormat(_Body):
    model_config = ConfigDict(json_schema_extra={"if": {
        "properties": {"type": {"const": "json_schema"}}, "required": ["type"],
    }, "then": {"properties": {"json_schema": {"type": "object"}}, "required": ["json_schema"]}})  # fmt: skip

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None
    """Required with type `json_schema`."""


_SET = {"json": {"anyOf": [{"type": "object"}, {"type": "string", "minLength": 1}]},
        "json_object": {"const": True},
        "regex": {"type": "string", "minLength": 1}, "grammar": {"type": "string", "minLength": 1},
        "choice": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}}  # fmt: skip


_EXACTLY_ONE: list[Any] = [
    {"required": [kind], "properties": {kind: schema}} for kind, schema in _SET.items()
]


class StructuredOutputsBody(_Body):
    """vLLM's `structured_outputs`: exactly one of json, json_object, regex, choice, grammar."""

    model_config = ConfigDict(json_schema_extra={"oneOf": _EXACTLY_ONE})

    json_: dict[str, Any] | Annotated[str, Field(min_length=1)] | None = Field(None, alias="json")
    """A JSON schema (an object, or its JSON text)."""
    json_object: bool | None = None
    # NOTE: the text kinds and `choice` are bounded here too, not only in the `oneOf`
    # alternative that chooses them: an empty one beside another kind (or alone) matched no
    # alternative's bound but the field's, and the server refused it.
    regex: str | None = Field(None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    """EBNF (GBNF) with a `root` rule."""
    disable_any_whitespace: bool = True
    """JSON kinds: compact JSON (true, duet's default) or any whitespace between tokens."""


def params(
    response_format: ResponseFormat | None, structured: StructuredOutputsBody | None
) -> StructuredOutputsParams | None:
    """The engine's spec from a request's fields; `InvalidInputError` naming the request's
    field (`response_format.json_schema.schema`, `structured_outputs.regex`, ...)."""
    wants_format = response_format is not None and response_format.type != "text"
    if wants_format and structured is not None:
        raise InvalidInputError("response_format", "cannot be combined with structured_outputs")
    if response_format is not None and wants_format:
        return _from_response_format(response_format)
    if structured is None:
        return None
    return StructuredOutputsParams(
        json=structured.json_,  # type: ignore[arg-type]  # a dict is serialized
        json_object=bool(structured.json_object),
        regex=structured.regex,
        choice=structured.choice,
        grammar=structured.grammar,
        whitespace=not structured.disable_any_whitespace,
    )


def _from_response_format(fmt: ResponseFormat) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None:
        raise InvalidInputError("response_format.json_schema", "is required with json_schema")
    if fmt.json_schema.schema_ is None:
        return StructuredOutputsParams(json_object=True)
    try:
        return StructuredOutputsParams(json=fmt.json_schema.schema_)  # type: ignore[arg-type]
    except InvalidInputError as e:
        raise InvalidInputError("response_format.json_schema.schema", e.message) from None
