"""vLLM's utility routes: `POST /tokenize` (a prompt, or chat messages rendered as
`/v1/chat/completions` renders them), `POST /detokenize`, `GET /version`."""

from __future__ import annotations

import importlib.metadata
from typing import Annotated, Any

from fastapi import FastAPI
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from duet.engine import InvalidInputError
from duet.router.errors import BadRequestError, format_loc
from duet.router.openai_chat import ChatPlan
from duet.router.openai_protocol import (
    CONTINUE_FINAL_MESSAGE_RULE,
    ChatCompletionRequest,
    ChatMessage,
    JsonInt,
    OpenAIModel,
    check_continue_final_message,
)
from duet.router.openai_tools import ChatTool
from duet.router.openapi import error_responses
from duet.router.serving_context import ServingContext


class TokenizeRequest(OpenAIModel):
    """Exactly one of `prompt` (text) and `messages` (a chat, with the chat fields that shape
    the prompt: tools, chat_template, chat_template_kwargs, add_generation_prompt,
    continue_final_message)."""

    model_config = ConfigDict(json_schema_extra={
        "oneOf": [
            {"properties": {"prompt": {"type": "string"}}, "required": ["prompt"]},
            {"properties": {"messages": {"type": "array"}}, "required": ["messages"]},
        ],
        "allOf": [CONTINUE_FINAL_MESSAGE_RULE],
    })  # fmt: skip

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    """Prompts only: add the tokenizer's special tokens (BOS), as /v1/completions does."""
    return_token_strs: bool = False
    tools: list[ChatTool] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    # NOTE: with a prompt too, as the schema states it (the chat fields do nothing there, but
    # a contradiction between them is still refused, not ignored).
    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_prompt(cls, value: bool, info: ValidationInfo) -> bool:
        return check_continue_final_message(value, info)

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


TOKENIZER_ID_SCHEMA = {"type": "integer", "minimum": 0, "x-duet-token-id": "tokenizer"}
"""A token id of the tokenizer; the served schema adds its largest (router/openapi.py)."""


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[Annotated[JsonInt, WithJsonSchema(TOKENIZER_ID_SCHEMA)]] = Field(
        max_length=1_000_000
    )


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def _chat_ids(ctx: ServingContext, body: TokenizeRequest) -> list[int]:
    """The prompt ids of a chat; `BadRequestError` naming the field."""
    fields = (
        "messages", "tools", "chat_template", "chat_template_kwargs", "add_generation_prompt",
        "continue_final_message",
    )  # fmt: skip
    try:
        chat = ChatCompletionRequest.model_validate({f: getattr(body, f) for f in fields})
    except ValidationError as e:
        first = e.errors()[0]
        param = format_loc(tuple(first["loc"]))
        message = str(first["msg"]).removeprefix("Value error, ")
        raise BadRequestError(f"{param}: {message}", param) from None
    plan = ChatPlan.of(chat, ctx.chat_options, ctx.engine.tokenizer)
    return plan.render(ctx.engine.tokenizer, chat, [m.to_template_message() for m in chat.messages])


def install_tokenize_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/tokenize", responses=error_responses(400, 401, 404))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(body.model)
        tokenizer = ctx.engine.tokenizer
        try:
            if body.prompt is not None:
                ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            else:
                ids = _chat_ids(ctx, body)
        except InvalidInputError as e:
            raise BadRequestError.from_invalid_input(e) from None
        strs = [tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs
        )

    @app.post("/detokenize", responses=error_responses(400, 401, 404))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        vocab_size = ctx.engine.tokenizer.vocab_size
        for i, token in enumerate(body.tokens):
            if not 0 <= token < vocab_size:
                raise BadRequestError(
                    f"tokens[{i}]: {token} is not a token id (0 to {vocab_size - 1})",
                    param=f"tokens[{i}]",
                )
        return DetokenizeResponse(prompt=ctx.engine.tokenizer.decode(body.tokens))

    @app.get("/version", responses=error_responses(401))
    async def version() -> VersionResponse:
        return VersionResponse(version=importlib.metadata.version("duet-serve"))
