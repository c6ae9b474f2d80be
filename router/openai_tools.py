"""OpenAI tool calling on REST (docs/tool_calling.md): the `tools` and `tool_choice` bodies,
the reply's `tool_calls` shapes, and `ToolPlan`, what one request asks of the tools.

- `tool_choice: "required"` and a named function are enforced by a grammar (a JSON schema
  built from the tools' parameter schemas), so the arguments always parse and validate.
- `"auto"` lets the model write tool calls in its own format; a tool-call parser
  (router/tool_parsers.py) turns them into OpenAI `tool_calls`.
- `"none"` (and no tools) is plain chat; the tools still reach the chat template.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from duet.engine import InvalidInputError, StructuredOutputsParams
from duet.router.openai_fields import warn_unknown_fields

ToolMode = Literal["none", "auto", "required", "named"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown_fields(cls, data: Any) -> Any:
        warn_unknown_fields(cls, data)
        return data


# -- requests ------------------------------------------------------------------------------


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object; none: an object with no parameters."""
    strict: bool | None = None
    """Accepted either way: `required` and named choices always enforce the schema exactly."""


class ChatTool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# -- replies (and assistant messages in requests) --------------------------------------------


class FunctionCall(_Body):
    name: str
    arguments: Annotated[str, WithJsonSchema(
        {"anyOf": [{"type": "string"}, {"type": "object"}]}, mode="validation"
    )]  # fmt: skip
    """The arguments as JSON text (OpenAI's shape; a JSON object is accepted in requests)."""

    @model_validator(mode="before")
    @classmethod
    def _arguments_as_text(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("arguments"), dict):
            return {**data, "arguments": json.dumps(data["arguments"], ensure_ascii=False)}
        return data


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def to_template(self) -> dict[str, Any]:
        """The shape chat templates read (transformers' convention, as vLLM passes it): the
        arguments as an object when they are one, so templates can `tojson` or iterate them."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """One streamed piece of a tool call: the first piece of call `index` carries its id,
    type and name; later pieces append to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


# -- one request's plan ------------------------------------------------------------------------


def openai_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def mistral_call_id() -> str:
    """Mistral's templates require ids of exactly 9 letters and digits."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


@dataclass
class ToolPlan:
    """What a request asks of its tools; `mode` "named" is a `tool_choice` naming a function."""

    mode: ToolMode
    tools: list[ChatTool]
    named: str | None = None
    parallel: bool = True
    new_id: Callable[[], str] = openai_call_id

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates read them (OpenAI's JSON shape), None when none."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar for `required` and a named function; None for `auto` and `none`."""
        if self.mode == "named":
            i, tool = next(
                (i, t) for i, t in enumerate(self.tools) if t.function.name == self.named
            )
            return _schema(f"tools[{i}].function.parameters", _parameters(tool))
        if self.mode != "required":
            return None
        for i, tool in enumerate(self.tools):  # name the tool whose schema does not compile
            _schema(f"tools[{i}].function.parameters", _parameters(tool))
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        if not self.parallel:
            array["maxItems"] = 1
        return _schema("tools", array)


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _schema(field: str, schema: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)  # type: ignore[arg-type]  # serialized
    except InvalidInputError as e:
        raise InvalidInputError(field, e.message) from None


def plan_tools(
    tools: list[ChatTool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    new_id: Callable[[], str] = openai_call_id,
) -> ToolPlan:
    """The request's plan; `InvalidInputError` naming `tool_choice` or `tools[i]...` for a
    choice that names no tool, a choice that needs tools without any, or a repeated name."""
    tools = list(tools or [])
    names: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if tool.function.name in names:
            raise InvalidInputError(
                f"tools[{i}].function.name",
                f"{tool.function.name!r} is also tools[{names[tool.function.name]}]'s name",
            )
        names[tool.function.name] = i
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in names:
            offered = ", ".join(repr(n) for n in names) or "none"
            raise InvalidInputError(
                "tool_choice",
                f"names function {name!r}, which is not in tools (tools offers {offered})",
            )
        return ToolPlan("named", tools, name, parallel, new_id)
    if tool_choice == "required" and not tools:
        raise InvalidInputError("tool_choice", "'required' needs at least one tool in tools")
    if not tools or tool_choice == "none":
        return ToolPlan("none", tools, None, parallel, new_id)
    return ToolPlan(tool_choice or "auto", tools, None, parallel, new_id)
