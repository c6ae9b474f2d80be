"""The Responses API's request body (`POST /v1/responses`) and its conversion to the chat turn
it runs as (docs/serving.md).

`input` (a string, or items: messages, `function_call`, `function_call_output`, `reasoning`)
becomes chat messages in the chat templates' shape, `instructions` a system message before
them, function `tools` and `tool_choice`, `text.format`, `max_output_tokens`, `temperature` and
`top_p` the chat request's own fields, `reasoning.effort` the template variable
`reasoning_effort`. A 400 names the Responses field (`input[2].call_id`,
`text.format.schema`), never the chat field it became (`ResponsesRename`).

Fields duet cannot honour are accepted and named in the `duet-ignored-fields` header
(`IGNORED`), as vLLM does.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
)

from duet.router.errors import BadRequestError, format_loc
from duet.router.openai_fields import Inert, ignored_fields
from duet.router.openai_protocol import INTEGRAL, ChatCompletionRequest, OpenAIModel, schema_rule

logger = logging.getLogger(__name__)

MAX_METADATA_KEYS = 16
"""OpenAI's limits on `metadata`: 16 pairs, keys up to 64 characters, values up to 512."""

ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    """Accepted either way: a required or named tool choice always enforces the schema."""


class NamedFunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ConversationRef(OpenAIModel):
    id: str


class ReasoningConfig(OpenAIModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    """Passed to chat templates as `reasoning_effort` (honoured where the template reads it)."""
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


OUTPUT_LOGPROBS = "message.output_text.logprobs"
"""The `include` entry that adds each reply token's logprobs to the message's `output_text`."""

Includable = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]
"""OpenAI's `include` values. Those of built-in tools and image inputs, which duet has none
of, are honoured trivially (nothing to include); `reasoning.encrypted_content` is named
ignored (duet keeps the reasoning of stored responses itself)."""

# Fields duet accepts without honouring them: field -> whether the value asks for nothing.
IGNORED: dict[str, Inert] = {
    "service_tier": lambda v: v in (None, "auto", "default"),
    "prompt": lambda v: v is None,
    "context_management": lambda v: not v,
    "stream_options": lambda v: not v,
    "prompt_cache_retention": lambda v: v is None,
    "background_options": lambda v: not v,
    "prompt_cache_options": lambda v: not v,
    "moderation": lambda v: v is None,
    "access_programs": lambda v: not v,
    "image": lambda v: not v,
}


_TEXT = {"type": "string"}
_TEXT_PARTS = {"type": "array", "items": {"anyOf": [
    {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"enum": ["input_text", "output_text", "text"]}, "text": _TEXT}},
    {"type": "object", "required": ["type", "refusal"], "properties": {
        "type": {"const": "refusal"}, "refusal": _TEXT}},
]}}  # fmt: skip
_CONTENT = {"anyOf": [_TEXT, _TEXT_PARTS]}
_ID = {"type": "string", "minLength": 1}
INPUT_ITEM_SCHEMA = {"anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"const": "message"},
        "role": {"enum": ["user", "system", "developer", "assistant"]},
        "content": _CONTENT}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"const": "function_call"}, "call_id": _ID, "name": _ID, "arguments": _TEXT}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": _ID, "output": _CONTENT}},
    {"type": "object", "required": ["type"], "properties": {
        "type": {"const": "reasoning"},
        "content": {"type": ["array", "null"]}, "summary": {"type": ["array", "null"]}}},
]}  # fmt: skip
"""An `input` item as `_messages` reads it (the schema says what it accepts)."""
METADATA_SCHEMA = {
    "type": "object", "maxProperties": 16, "propertyNames": {"maxLength": 64},
    "additionalProperties": {"type": "string", "maxLength": 512},
}  # fmt: skip
"""OpenAI's `metadata`: at most 16 pairs, keys up to 64 characters, values up to 512
(`check_metadata`)."""


def check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's limits on a `metadata` map (`MAX_METADATA_KEYS`); a ValueError otherwise."""
    if value is None:
        return value
    if len(value) > MAX_METADATA_KEYS:
        raise ValueError(f"at most {MAX_METADATA_KEYS} pairs; got {len(value)}")
    for key, item in value.items():
        if len(key) > 64 or len(item) > 512:
            raise ValueError(f"{key[:64]!r}: keys up to 64 characters, values up to 512")
    return value


Metadata = Annotated[
    dict[str, str], AfterValidator(check_metadata), WithJsonSchema(METADATA_SCHEMA)
]
"""A `metadata` field: checked by `check_metadata`, bounded so in the served schema."""


class ResponsesRequest(OpenAIModel):
    # Without instructions or a previous response, the input is the whole conversation.
    model_config = ConfigDict(json_schema_extra={"allOf": [
        schema_rule({"background": {"const": True}}, {"store": {"const": True}}, required=False),
        schema_rule({"tool_choice": {"const": "required"}}, {"tools": {"type": "array", "minItems": 1}}),
        {
        "if": {"properties": {
            "instructions": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 0}]},
            "previous_response_id": {"type": "null"},
        }},
        "then": {"properties": {"input": {"minLength": 1, "contains": {  # a message, not reasoning
            "not": {"properties": {"type": {"const": "reasoning"}}, "required": ["type"]}
        }}}, "required": ["input"]},
    }]})  # fmt: skip

    model: str | None = None
    input: Annotated[
        str | list[dict[str, Any]],
        WithJsonSchema(
            {"anyOf": [_TEXT, {"type": "array", "items": INPUT_ITEM_SCHEMA}]}, mode="validation"
        ),
    ] = ""
    """A string (one user message) or a list of items; see `input_messages`."""
    instructions: str | None = None
    """A system message before the input (never carried over by `previous_response_id`)."""
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    """Keep the response (`GET /v1/responses/{id}`, `previous_response_id`): needs a session
    store."""
    background: bool = False
    """Run from the work queue; the reply is the response `queued` (needs `store`)."""
    previous_response_id: str | None = None
    metadata: Metadata | None = None
    reasoning: ReasoningConfig | None = None
    max_tool_calls: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    """Built-in tool calls only (duet has none): honoured trivially."""
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    """Accepted: duet caches prompt prefixes on its own."""
    truncation: Literal["auto", "disabled"] | None = None
    """auto: a conversation too long for the context drops its oldest turns (whole, from a
    user message on; the instructions stay) until it fits; disabled (the default): a 400."""
    conversation: str | ConversationRef | None = None
    """A stored conversation (router/conversations.py): its items come before `input`, and the
    turn's input and output items are appended to it once the reply ended."""
    include: list[Includable] | None = None
    """`message.output_text.logprobs`: the reply's logprobs (see `top_logprobs`)."""
    top_logprobs: Annotated[int, Field(ge=0, le=20), INTEGRAL] | None = None
    """How many most likely tokens each reply token's logprob lists (0-20); above 0 it asks
    for the logprobs without `include` too."""
    # accepted, not honoured (`IGNORED`)
    service_tier: str | None = None
    prompt: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    stream_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    background_options: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None

    def ignored(self) -> list[str]:
        """The fields this request sets that duet does not honour (logged once here), nested
        ones by their path (`text.verbosity`: the reply's length is the model's;
        `reasoning.summary`: no summaries are written)."""
        names = ignored_fields(self, IGNORED, "POST /v1/responses")
        nested = {
            "include.reasoning.encrypted_content": "reasoning.encrypted_content"
            in (self.include or []),
            "text.verbosity": self.text is not None and self.text.verbosity is not None,
            "reasoning.summary": self.reasoning is not None
            and (self.reasoning.summary or self.reasoning.generate_summary) is not None,
        }
        unhonoured = [name for name, asked in nested.items() if asked]
        if unhonoured:
            logger.warning("POST /v1/responses: ignoring fields duet does not implement: %s",
                           unhonoured)  # fmt: skip
        return names + unhonoured

    @property
    def conversation_id(self) -> str | None:
        c = self.conversation
        return c.id if isinstance(c, ConversationRef) else c

    def input_items(self) -> list[dict[str, Any]]:
        """`input` as items (a string: one user message)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}] if self.input else []
        return list(self.input)

    @property
    def wants_logprobs(self) -> bool:
        """The reply's logprobs go in its `output_text` (and its delta events)."""
        return OUTPUT_LOGPROBS in (self.include or []) or bool(self.top_logprobs)

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages in the templates' shape; a 400 naming `input[i]...`."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}] if self.input else []
        return list(_messages(self.input))

    def to_chat(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this response runs as, over `messages` (the previous responses'
        conversation, then `input_messages`)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if not system and not messages:
            raise BadRequestError("input: must hold at least one message", param="input")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [*system, *messages],
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        choice = self.tool_choice
        if isinstance(choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            body["tool_choice"] = choice
        fmt = self.text.format if self.text is not None else None
        # NOTE: a required or named tool choice answers with tool calls only, never text, so
        # the text format has nothing to shape (OpenAI accepts both; chat's grammar takes one).
        calls_only = choice == "required" or isinstance(choice, NamedFunctionChoice)
        if fmt is not None and fmt.type != "text" and not calls_only:
            spec = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
            body["response_format"] = {"type": fmt.type, "json_schema": spec}
            if fmt.type == "json_object":
                del body["response_format"]["json_schema"]
        if self.wants_logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["chat_template_kwargs"] = {"reasoning_effort": self.reasoning.effort}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:  # the items passed their own checks: name the field
            error = e.errors()[0]
            param = RESPONSES_RENAME.get(format_loc(tuple(error["loc"])) or "")
            message = str(error["msg"]).removeprefix("Value error, ")
            raise BadRequestError(f"{param}: {message}", param=param) from None


def input_item_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items (as `input` takes them, or a conversation's) -> chat messages; a 400
    naming `input[i]...`."""
    return list(_messages(items))


def _messages(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Input items -> chat messages: consecutive `function_call`s join one assistant message
    (after the assistant text before them, if any); a `reasoning` item's text goes with the
    assistant message after it."""
    pending: dict[str, Any] | None = None  # the assistant message being built
    reasoning = ""
    for i, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            reasoning += _reasoning_text(item, i)
            continue
        if kind == "function_call":
            call = {
                "id": _string(item, "call_id", i),
                "type": "function",
                "function": {"name": _string(item, "name", i),
                             "arguments": _string(item, "arguments", i)},
            }  # fmt: skip
            if pending is None:
                pending = {"role": "assistant", "content": ""}
            pending.setdefault("tool_calls", []).append(call)
            continue
        if pending is not None:
            yield _with_reasoning(pending, reasoning)
            pending, reasoning = None, ""
        if kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = _text_of(output, f"input[{i}].output")
            if not isinstance(output, str):
                raise _bad(f"input[{i}].output", "must be a string or a list of text parts")
            yield {"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": output}
        elif kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"input[{i}].role", "must be one of user, system, developer, assistant")
            content = item.get("content")
            if isinstance(content, list):
                content = _text_of(content, f"input[{i}].content")
            if not isinstance(content, str):
                raise _bad(f"input[{i}].content", "must be a string or a list of text parts")
            if role == "assistant":
                pending = {"role": "assistant", "content": content}
            else:
                yield {"role": role, "content": content}
        else:
            raise _bad(
                f"input[{i}].type",
                f"{kind!r} is not supported; items are message, function_call, "
                "function_call_output and reasoning",
            )
    if pending is not None:
        yield _with_reasoning(pending, reasoning)


def _with_reasoning(message: dict[str, Any], reasoning: str) -> dict[str, Any]:
    return {**message, "reasoning_content": reasoning} if reasoning else message


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise _bad(f"input[{i}].{key}", f"is required in {item.get('type')} items (a string)")
    return value


def _text_of(parts: list[Any], path: str) -> str:
    """Text parts (input_text, output_text, text, refusal) joined; anything else a 400."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if kind else None
        if kind not in ("input_text", "output_text", "text", "refusal") or not isinstance(
            text, str
        ):
            raise _bad(
                f"{path}[{j}]",
                f"type {kind!r} is not supported; only text parts (input_text, output_text)",
            )
        texts.append(text)
    return "\n".join(texts)


def _reasoning_text(item: dict[str, Any], i: int) -> str:
    """A reasoning item's text: its `content` (reasoning_text parts), else its `summary`
    (summary_text parts); each must be a list or null, whichever is read."""
    for key, part in (("content", "reasoning_text"), ("summary", "summary_text")):
        if not isinstance(item.get(key), (list, type(None))):
            raise _bad(f"input[{i}].{key}", f"must be a list of {part} parts or null")
    parts = item.get("content")
    if parts is None:
        parts = item.get("summary") or []
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict))


def _bad(param: str, message: str) -> BadRequestError:
    return BadRequestError(f"{param}: {message}", param=param)


class ResponsesRename(Mapping[str, str]):
    """Chat field names (as a chat turn's 400s name them) -> the Responses request's."""

    _RULES = (
        (re.compile(r"^messages(\[\d+\])?(\..*)?$"), "input"),
        (re.compile(r"^max_(completion_)?tokens$"), "max_output_tokens"),
        (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
        (re.compile(r"^response_format(\..*)?$"), "text.format"),
        (re.compile(r"^tools(\[\d+\])\.function\.(\w+)"), r"tools\1.\2"),
        (re.compile(r"^chat_template_kwargs(\..*)?$"), "reasoning.effort"),
        (re.compile(r"^prompt$"), "input"),
    )

    def __getitem__(self, key: str) -> str:
        for pattern, replacement in self._RULES:
            if pattern.match(key):
                return pattern.sub(replacement, key, count=1)
        return key

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def get(self, key: str, default: Any = None) -> Any:
        return self[key]


RESPONSES_RENAME = ResponsesRename()
