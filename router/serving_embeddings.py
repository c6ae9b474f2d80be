"""`POST /v1/embeddings`, OpenAI's: one vector per input (a string, a list of strings, token ids
or a list of token-id lists), the model's final hidden states pooled (`--embedding-pooling`:
`last`, the last token's, as vLLM pools decoder models, or `mean`) and scaled to unit length,
as floats or as base64 of little-endian float32 (`encoding_format`; the official client asks
for base64 and decodes it). The engine computes them as requests that run their prompt and
sample one token it drops (`SamplingParams.pooling`), batched with everything else.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Annotated, Literal

from fastapi import Request, Response
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from duet.engine import InvalidInputError, SamplingParams
from duet.router.auth import caller_api_key
from duet.router.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, run_until_disconnect
from duet.router.errors import BadRequestError, OpenAIError, as_openai_error
from duet.router.openai_protocol import INTEGRAL, PROMPT_SCHEMA, PromptInput
from duet.router.serving_completion import final_outputs
from duet.router.serving_context import ServingContext

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


class EmbeddingsUnavailableError(OpenAIError):
    status_code = 400
    type = "invalid_request_error"


class EmbeddingHandler:
    def __init__(self, ctx: ServingContext, pooling: str) -> None:
        self.ctx = ctx
        self.params = SamplingParams(temperature=0.0, max_tokens=1, pooling=pooling)

    async def create(self, body: EmbeddingRequest, raw: Request) -> Response:
        arrival_s = time.monotonic()
        ctx = self.ctx
        ctx.check_model(body.model)
        if not ctx.engine.computes_embeddings:
            raise EmbeddingsUnavailableError(
                "input: this server's engine does not compute embeddings (a disaggregated "
                "cluster, or pipeline stages, do not yet); serve the model aggregated",
                param="input",
            )
        try:
            prompts = [ctx.engine.tokenize_prompt(p)[1] for p in body.inputs()]
            for ids in prompts:
                ctx.engine.check_lengths(len(ids), self.params)
        except InvalidInputError as e:
            raise BadRequestError.from_invalid_input(e, {"prompt": "input"}) from None
        ctx.check_engine()
        num_tokens = sum(len(ids) for ids in prompts)
        await ctx.rate_limiter.admit(caller_api_key(raw), num_tokens)
        tickets = ctx.admission.admit([1] * len(prompts))
        request_id = f"embd-{uuid.uuid4().hex}"
        streams = [
            ctx.generate(ids, self.params, f"{request_id}-{i}", ticket, arrival_s)
            for i, (ids, ticket) in enumerate(zip(prompts, tickets, strict=True))
        ]
        try:
            finals = await run_until_disconnect(raw, final_outputs(streams))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as e:
            raise as_openai_error(e, request_id) from e
        finally:
            for ticket in tickets:
                ticket.release()
        vectors = [out.embedding for out in finals]
        if any(v is None for v in vectors):
            raise RuntimeError("the engine ended an embedding request without its vector")
        width = len(vectors[0] or [])
        if body.dimensions is not None and body.dimensions != width:
            raise BadRequestError(
                f"dimensions: this model's embeddings have {width} dimensions and cannot be "
                f"shortened; got {body.dimensions} (leave it out, or send {width})",
                param="dimensions",
            )
        data = [
            Embedding(index=i, embedding=_encode(v or [], body.encoding_format))
            for i, v in enumerate(vectors)
        ]
        usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        reply = EmbeddingResponse(data=data, model=ctx.model_name, usage=usage)
        return Response(reply.model_dump_json(), media_type="application/json")


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
