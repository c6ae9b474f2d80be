"""OpenAI-compatible REST bodies: chat completions, completions, models, errors.

Field names follow OpenAI's API, plus vLLM's sampling extras (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, return_tokens_as_token_ids,
structured_outputs) and duet's `session_id`. OpenAI fields duet does not implement are
accepted, and named in the `duet-ignored-fields` header when their value asks for something
(router/openai_fields.py); fields that are not OpenAI's are ignored with a warning naming them,
as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from duet.engine import InvalidInputError, SamplingParams
from duet.engine.sampling_params import MAX_LOGIT_BIAS
from duet.router import structured_protocol
from duet.router.openai_fields import UnsupportedChatFields, warn_unknown_fields
from duet.router.openai_tools import ChatTool, ToolCall, ToolChoice
from duet.router.structured_protocol import ResponseFormat

MAX_N = 128
"""Most completions per prompt (OpenAI's limit)."""
MAX_LOGPROBS = 20
"""Most top alternatives per token (the engine's limit)."""
INT64_MIN, INT64_END = -(2**63), 2**63
"""A seed's range, [INT64_MIN, INT64_END). NOTE: the end is exclusive because the served
schema holds its bounds as floats (FastAPI's OpenAPI models): 2^63 - 1 would read as 2^63 there,
a bound the server refused, while -2^63 and 2^63 are exact."""


LONE_SURROGATE = "lone_surrogate"
"""The validation error type of a string holding a lone UTF-16 surrogate (router/errors.py
appends its `ctx["path"]` to the error's location)."""


def lone_surrogate_path(value: Any) -> tuple[int | str, ...] | None:
    """Where under `value` (a parsed JSON value) a string or an object's key holds a lone UTF-16
    surrogate (JSON's `"\\ud800"` escapes parse to one), or None. No tokenizer, template or
    store takes those."""
    if isinstance(value, str):
        return None if _is_unicode(value) else ()
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not _is_unicode(key):  # named escaped: the error is JSON
                return (key.encode("utf-8", "backslashreplace").decode("utf-8"),)
            if (inner := lone_surrogate_path(item)) is not None:
                return (key, *inner)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if (inner := lone_surrogate_path(item)) is not None:
                return (index, *inner)
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _integral_float_to_int(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


INTEGRAL = BeforeValidator(_integral_float_to_int)
"""An integer field of a body reads JSON-schema's `integer`, so `3.0` is one; `true` and `"3"`
are not (the bodies are strict). NOTE: after any `Field` constraints in the `Annotated`, or the
schema shows pydantic's `ge` instead of `minimum`."""
JsonInt = Annotated[int, INTEGRAL]
ALLOWED_TOKEN_IDS_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0, "x-duet-token-id": "model"},
}
"""What `allowed_token_ids` accepts (the served schema bounds the ids: router/openapi.py)."""
TRUNCATE_PROMPT_TOKENS_SCHEMA = {
    "anyOf": [{"type": "integer", "minimum": 1, "x-duet-context": True}, {"const": -1}]
}
"""What `truncate_prompt_tokens` accepts (the served schema bounds it by the context)."""
TRUNCATE_RANGE = "must be -1 (the model's context length) or an integer >= 1; got {}"


def check_truncate_range(keep: int | None) -> int | None:
    """`truncate_prompt_tokens` as a field validator sees it: -1, >= 1 or None."""
    if keep is not None and keep < 1 and keep != -1:
        raise ValueError(TRUNCATE_RANGE.format(keep))
    return keep


def prompt_of_one_shape(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A prompt field (`prompt`, `input`) validated as one of `PromptInput`'s shapes, with one
    error naming them all instead of pydantic's one per shape tried."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        ) from None


def truncate_prompt(prompt_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` ids (-1: the model's context
    length; None: all of them). `InvalidInputError` naming the field for 0, below -1 or more
    than the context."""
    if keep is None:
        return prompt_ids
    if keep < 1 and keep != -1:
        raise InvalidInputError("truncate_prompt_tokens", TRUNCATE_RANGE.format(keep))
    if keep > max_model_len:
        raise InvalidInputError(
            "truncate_prompt_tokens",
            f"must be at most the model's context ({max_model_len}) or -1; got {keep}",
        )
    return prompt_ids[-(max_model_len if keep == -1 else keep) :]


LOGIT_BIAS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "propertyNames": {"pattern": "^[0-9]+$"},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
}
"""What `logit_bias` accepts (the vocabulary's bound on the ids is the server's check)."""


def schema_rule(
    when: dict[str, Any], then: dict[str, Any], required: bool = True
) -> dict[str, Any]:
    """A JSON-schema `if`/`then` for a body's cross-field rule its validators enforce: when the
    properties in `when` are present with those values, those in `then` must match (and, with
    `required`, be present). The OpenAPI schema then says what the server accepts."""
    rule: dict[str, Any] = {"properties": then}
    if required:
        rule["required"] = sorted(then)
    return {"if": {"properties": when, "required": sorted(when)}, "then": rule}


ONE_STRUCTURED_OUTPUT_RULE: dict[str, Any] = {"not": {
    "properties": {"response_format": {"type": "object"}, "structured_outputs": {"type": "object"}},
    "required": ["response_format", "structured_outputs"],
}}  # fmt: skip
"""`response_format` and `structured_outputs` are never both given."""

CONTINUE_FINAL_MESSAGE_RULE = schema_rule(
    {"continue_final_message": {"const": True}}, {"add_generation_prompt": {"const": False}}
)
"""`continue_final_message` needs `add_generation_prompt` false (its default is true)."""


def check_continue_final_message(value: bool, info: ValidationInfo) -> bool:
    """`CONTINUE_FINAL_MESSAGE_RULE` for a model whose `add_generation_prompt` comes first."""
    if value and info.data.get("add_generation_prompt"):
        raise ValueError("cannot be true with add_generation_prompt (set that to false)")
    return value


class OpenAIModel(BaseModel):
    """Base of every body: unknown request fields are ignored with a warning naming them;
    strings must be valid Unicode; values have their schema's JSON type (`strict`: no `true`
    for an integer, no `"3"` for a number, as the OpenAPI schema says)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown_fields(cls, data: Any) -> Any:
        if (path := lone_surrogate_path(data)) is not None:
            raise PydanticCustomError(
                LONE_SURROGATE,
                "contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape); strings "
                "must be valid Unicode",
                {"path": path},
            )
        warn_unknown_fields(cls, data)
        return data


# -- requests ------------------------------------------------------------------------------


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    """Send a last chunk with token usage (choices empty) before `[DONE]`."""
    continuous_usage_stats: bool = False
    """vLLM's: with `include_usage`, every chunk also carries the usage so far (the prompt's
    tokens and the completion tokens generated up to that chunk)."""


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        schema_rule({"role": {"const": "tool"}},
                    {"tool_call_id": {"type": "string", "minLength": 1}}),
        schema_rule({"role": {"enum": ["system", "user", "tool", "developer"]}},
                    {"tool_calls": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}},
                    required=False),
    ]})  # fmt: skip

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextContentPart] | None = None
    """A string, or a list of text parts (joined with newlines, as vLLM does)."""
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """Assistant messages: the calls the assistant made (they reach the chat template)."""
    tool_call_id: str | None = Field(None, validate_default=True)
    """Tool messages (required there): the call this message answers."""
    reasoning_content: str | None = None
    """Assistant messages: earlier thinking, for templates that render it (Qwen3)."""

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(
        cls, value: list[ToolCall] | None, info: ValidationInfo
    ) -> list[ToolCall] | None:
        if value and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_messages_answer_a_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("role") == "tool" and not value:
            raise ValueError("is required in tool messages (the id of the call it answers)")
        return value

    @field_validator("content", mode="wrap")
    @classmethod
    def _check_content(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # NOTE: re-raised with one clear message; pydantic's own names each union member.
        try:
            return handler(value)
        except ValidationError:
            if isinstance(value, list):
                for j, part in enumerate(value):
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind != "text":
                        raise ValueError(
                            f"content[{j}] has type {kind!r}; only text parts "
                            '({"type": "text", "text": ...}) are supported'
                        ) from None
                    if not isinstance(part.get("text"), str):
                        raise ValueError(f"content[{j}].text must be a string") from None
            raise ValueError("must be a string or a list of text content parts") from None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def to_template_message(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' shape)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.to_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class SamplingRequest(OpenAIModel):
    """Fields shared by chat completions and completions."""

    model: str | None = None
    """Served model name; None means the one model this server serves."""
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: JsonInt = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[
        str | list[str] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "items": {"type": "string", "minLength": 1}},
                    {"type": "null"},
                ]
            },
            mode="validation",
        ),
    ] = None
    seed: Annotated[int, Field(ge=INT64_MIN, lt=INT64_END), INTEGRAL] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: Annotated[dict[str, float], WithJsonSchema(LOGIT_BIAS_SCHEMA)] | None = None
    """Token id (as a string of digits, OpenAI's form) -> a bias in [-100, 100] added to its
    logit before sampling; ids outside the model's vocabulary are a 400."""
    user: str | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1), INTEGRAL] | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: JsonInt = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: (
        list[Annotated[JsonInt, WithJsonSchema({"type": "integer", "minimum": 0})]] | None
    ) = None
    allowed_token_ids: (
        Annotated[list[JsonInt], Field(min_length=1), WithJsonSchema(ALLOWED_TOKEN_IDS_SCHEMA)]
        | None
    ) = None
    """Only these token ids may be sampled; ids outside the model's vocabulary are a 400."""
    include_stop_str_in_output: bool = False
    """A stop string that ends the output stays at the end of its text."""
    bad_words: list[Annotated[str, Field(pattern=r"\S")]] | None = None
    """Words the output never contains as tokenized (vLLM's rule: with and without a leading
    space)."""
    cache_salt: str | None = Field(None, min_length=1)
    """Only requests with the same salt share prefix-cached KV blocks."""
    truncate_prompt_tokens: (
        Annotated[int, INTEGRAL, WithJsonSchema(TRUNCATE_PROMPT_TOKENS_SCHEMA)] | None
    ) = None
    """Keep only the prompt's last this many tokens (-1: the model's context length); more
    than the context is a 400."""
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    """Logprob tokens read `token_id:<id>` instead of text (exact for any tokenizer)."""
    structured_outputs: structured_protocol.StructuredOutputsBody | None = None
    priority: JsonInt = Field(
        0, ge=-(2**31), le=2**31 - 1, json_schema_extra={"x-duet-priority": True}
    )
    """Lower runs first when the server schedules by priority (else only 0 is accepted)."""
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    """vLLM's extra: every prompt token's logprob (after the first) and this many top
    alternatives, in the response's `prompt_logprobs` (docs/tool_calling.md)."""
    # duet
    session_id: str | None = None
    """Chat only: a session from `POST /v1/sessions` whose history comes before `messages`;
    the turn is stored once the reply completes (see router/sessions.py)."""

    @field_validator("stop", mode="wrap")
    @classmethod
    def _check_stop(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("must be a string or a list of strings") from None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate_prompt_tokens(cls, value: int | None) -> int | None:
        return check_truncate_range(value)

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """`truncate_prompt(prompt_ids, self.truncate_prompt_tokens, max_model_len)`."""
        return truncate_prompt(prompt_ids, self.truncate_prompt_tokens, max_model_len)

    @field_validator("logit_bias", mode="wrap")
    @classmethod
    def _check_logit_bias(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            bias = handler(value)
        except ValidationError:
            raise ValueError("must be a map of token ids to numbers in [-100, 100]") from None
        for key, number in (bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids (integers >= 0); got {key!r}")
            if not -MAX_LOGIT_BIAS <= number <= MAX_LOGIT_BIAS:
                raise ValueError(f"values must be in [-100, 100]; got {number!r} for token {key}")
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far (vLLM's `continuous_usage_stats`,
        which, as in vLLM, needs `include_usage`)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        fmt: ResponseFormat | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Engine parameters. Raises `InvalidInputError` naming the engine-side field."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured_protocol.params(fmt, self.structured_outputs),
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            cache_salt=self.cache_salt,
            bad_words=list(self.bad_words or []),
        )


class ChatCompletionRequest(SamplingRequest, UnsupportedChatFields):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        CONTINUE_FINAL_MESSAGE_RULE,
        ONE_STRUCTURED_OUTPUT_RULE,
        schema_rule({"tool_choice": {"const": "required"}}, {"tools": {"type": "array", "minItems": 1}}),
        # A background request's result is replayed as chunks: one sample, no prompt
        # logprobs; it renders its prompt in the runner, with the default template and
        # priority (not yet otherwise: router/openai_chat.py).
        schema_rule({"background": {"const": True}}, {
            "n": {"const": 1}, "prompt_logprobs": {"type": "null"},
            "stream": {"const": False}, "priority": {"const": 0},
            "chat_template": {"type": "null"}, "chat_template_kwargs": {"type": "null"},
            "continue_final_message": {"const": False}, "add_generation_prompt": {"const": True},
        }, required=False),
        schema_rule({"top_logprobs": {"type": "integer", "minimum": 1}}, {"logprobs": {"const": True}}),
    ]})  # fmt: skip

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    """Overrides `max_tokens` (OpenAI's newer name). Neither: up to the context length."""
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    background: bool = False
    """duet: enqueue the request and answer at once with its id; fetch or stream the result
    later from any replica (router/background.py)."""
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    """none, auto (the default with tools), required, or {"type": "function", "function":
    {"name": ...}}; docs/tool_calling.md."""
    parallel_tool_calls: bool | None = None
    """false: at most one tool call per reply."""
    # vLLM's chat-template extras
    chat_template: str | None = None
    """A Jinja chat template for this request instead of the model's."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra template variables (e.g. {"enable_thinking": false} for Qwen3)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """Continue the last (assistant) message instead of starting a new one."""

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _check_tool_choice(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(
                'must be "none", "auto", "required" or {"type": "function", "function": '
                '{"name": ...}}'
            ) from None

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_prompt(cls, value: bool, info: ValidationInfo) -> bool:
        return check_continue_final_message(value, info)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("requires logprobs to be true")
        return value

    @property
    def max_tokens_field(self) -> str:
        """The name of the field that set the output budget, for error messages."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, self.response_format)


PromptInput = str | list[JsonInt] | list[list[JsonInt]] | list[str]


TOKEN_ID_SCHEMA = {"type": "integer", "minimum": 0, "x-duet-token-id": "model"}
"""A prompt's token id; the served schema adds the model's largest (router/openapi.py)."""

PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
    {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1},
    {"type": "array", "items": {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1},
     "minItems": 1},
]}  # fmt: skip
"""What `prompt` accepts: no empty prompt (nothing to continue from), ids in the vocabulary."""


class CompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        ONE_STRUCTURED_OUTPUT_RULE,
        {"properties": {"session_id": {"type": "null"}}},  # sessions hold chats
        schema_rule({"max_tokens": {"const": 0}}, {"echo": {"const": True}}),  # prompt only
    ]})  # fmt: skip

    prompt: Annotated[PromptInput, WithJsonSchema(PROMPT_SCHEMA)]
    """A string, a list of strings, token ids, or a list of token-id lists."""
    max_tokens: Annotated[int, Field(ge=0), INTEGRAL] | None = 16
    """0 (with `echo`): no output, only the prompt (and its logprobs with `logprobs`), what
    eval harnesses send to score a text."""
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    echo: bool = False
    """Each choice's text starts with its prompt; with `logprobs`, so do its logprobs (the
    first prompt token's null)."""
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})
    best_of: JsonInt | None = None
    response_format: ResponseFormat | None = None  # vLLM's extra here (OpenAI's on chat)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return prompt_of_one_shape(value, handler)

    @field_validator("suffix")
    @classmethod
    def _unsupported(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("is not supported by this server")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != info.data.get("n"):
            raise ValueError("other than n is not supported by this server")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]  # one prompt of token ids
        if not p:
            return [[]]  # the engine names the empty prompt
        return list(p)  # type: ignore[arg-type]

    @property
    def prompt_only(self) -> bool:
        """`max_tokens: 0`: the echoed prompt is the whole reply (no completion tokens)."""
        return self.max_tokens == 0

    @property
    def echo_logprobs(self) -> bool:
        """Whether the echoed prompt carries logprobs (which needs prompt logprobs)."""
        return self.echo and self.logprobs is not None

    def to_sampling_params(self) -> SamplingParams:
        """Engine parameters. A prompt-only request (`max_tokens: 0`) runs one token, which the
        reply leaves out: the prompt's logprobs come with the first sample."""
        prompt_logprobs = self.prompt_logprobs
        if self.echo_logprobs:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs or 0)
        if self.prompt_only and not self.echo:
            raise InvalidInputError(
                "max_tokens", "must be >= 1 unless echo is true (0 returns only the prompt)"
            )
        max_tokens = 1 if self.prompt_only else self.max_tokens
        return self._sampling_params(
            max_tokens, self.logprobs, self.response_format, prompt_logprobs
        )
