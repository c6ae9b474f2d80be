"""`POST /v1/embeddings`' request and response, OpenAI's shapes (router/serving_embeddings.py
serves them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
)

from duet.router.openai_protocol import (
    INTEGRAL,
    PROMPT_SCHEMA,
    TRUNCATE_PROMPT_TOKENS_SCHEMA,
    PromptInput,
    check_truncate_range,
    prompt_of_one_shape,
)

MAX_INPUTS = 2048
"""Most inputs in one request (OpenAI's limit)."""


class EmbeddingRequest(BaseModel):
    # Strict about names: a field this server does not know is a 400, never ignored. Strict
    # about types as every body is (`OpenAIModel`): `true` is no integer, `"3"` no number.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    input: Annotated[PromptInput, WithJsonSchema(PROMPT_SCHEMA)]
    """A string, a list of strings, token ids, or a list of token-id lists; none empty."""
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    """Must be the model's own width: its vectors are not shortened (it was not trained to
    be cut, as OpenAI's text-embedding-3 models are)."""
    user: str | None = None
    """OpenAI's end-user id: accepted, not used."""
    truncate_prompt_tokens: (
        Annotated[int, INTEGRAL, WithJsonSchema(TRUNCATE_PROMPT_TOKENS_SCHEMA)] | None
    ) = None
    """vLLM's: embed only each input's last this many tokens (-1: as many as fit, the model's
    context less one, the token an embedding request samples and drops), so a text longer
    than the context is cut, not refused; more than the context is a 400."""

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate(cls, value: int | None) -> int | None:
        return check_truncate_range(value)

    @field_validator("input", mode="wrap")
    @classmethod
    def _one_of_the_shapes(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return prompt_of_one_shape(value, handler)

    @field_validator("input")
    @classmethod
    def _bounded(cls, value: PromptInput) -> PromptInput:
        if isinstance(value, list) and value and not isinstance(value[0], int):
            if len(value) > MAX_INPUTS:
                raise ValueError(f"at most {MAX_INPUTS} inputs; got {len(value)}")
        return value

    def inputs(self) -> list[str | list[int]]:
        """The input as a list of prompts (text or token ids)."""
        p = self.input
        if isinstance(p, str):
            return [p]
        if not p or all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]  # one prompt of token ids (or the empty one)
        return list(p)  # type: ignore[arg-type]


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str
    """Floats, or base64 of little-endian float32 values with `encoding_format: base64`."""


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
