"""OpenAI-compatible REST replies: chat completions (whole and streamed chunks), completions,
models, errors. Requests are in router/openai_protocol.py."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, field_serializer

from duet.router.openai_tools import DeltaToolCall, ToolCall


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, num_prompt: int, num_completion: int, num_cached: int = 0) -> Usage:
        return cls(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
        )


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    """None when the reply is only tool calls (as OpenAI answers)."""
    reasoning_content: str | None = None
    """The model's thinking, with a reasoning parser (docs/tool_calling.md); None otherwise."""
    tool_calls: list[ToolCall] = Field(default_factory=list)


class PromptTokenLogprob(BaseModel):
    """vLLM's shape of one prompt-logprob entry (keyed by token id in its position's map)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]
"""One map per prompt token (null for the first): the prompt token, then the top-k."""


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class BackgroundChatCompletion(BaseModel):
    """A `background` chat's answer to its POST (and to a retrieve while it is not done): no
    choices or usage yet; `GET /v1/chat/completions/{id}` gives the result when it is done."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice] = Field(max_length=0)
    status: Literal["queued", "in_progress"]


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: DeltaMessage) -> dict[str, Any]:
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """duet/vLLM: in one chunk (with no choices) before the first token's."""


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    """Both the full response and each streamed chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "duet"
    max_model_len: int
    deterministic: bool = False
    """duet's extension: whether greedy (and seeded) output is independent of batching,
    chunking, prefix-cache hits and disaggregation (docs/determinism.md)."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
