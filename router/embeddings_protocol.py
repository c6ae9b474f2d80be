"""`POST /v1/embeddings`' request and response, OpenAI's shapes (router/serving_embeddings.py
serves them)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from duet.router.openai_protocol import INTEGRAL, PROMPT_SCHEMA, PromptInput

MAX_INPUTS = 2048
"""Most inputs in one request (OpenAI's limit)."""


class EmbeddingRequest(BaseModel):
    # Strict about names: a field this server does not know is a 400, never ignored.
    model_config = ConfigDict(extra="forbid")

    input: Annotated[PromptInput, WithJsonSchema(PROMPT_SCHEMA)]
    """A string, a list of strings, token ids, or a list of token-id lists; none empty."""
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    """Must be the model's own width: its vectors are not shortened (it was not trained to
    be cut, as OpenAI's text-embedding-3 models are)."""
    user: str | None = None
    """OpenAI's end-user id: accepted, not used."""

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
