"""`POST /v1/embeddings`, OpenAI's: one vector per input (a string, a list of strings, token ids
or a list of token-id lists), the model's final hidden states pooled (`--embedding-pooling`:
as the model's sentence-transformers config declares, else `last`, the last token's, as vLLM
pools decoder models; or `last`, `mean`, `cls` named) and scaled to unit length,
as floats or as base64 of little-endian float32 (`encoding_format`; the official client asks
for base64 and decodes it). The engine computes them as requests that run their prompt and
sample one token it drops (`SamplingParams.pooling`), batched with everything else.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import Sequence

from fastapi import Request, Response

from duet.engine import InvalidInputError, SamplingParams
from duet.engine.llm_engine import Prompt
from duet.engine.sampling_params import POOLING_TYPES
from duet.router.auth import caller_api_key
from duet.router.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, run_until_disconnect
from duet.router.embeddings_protocol import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from duet.router.errors import BadRequestError, as_openai_error
from duet.router.openai_protocol import truncate_prompt
from duet.router.serving_completion import final_outputs
from duet.router.serving_context import ServingContext


class EmbeddingHandler:
    def __init__(self, ctx: ServingContext, pooling: str = "auto") -> None:
        """`pooling`: `last`, `mean`, `cls`, or `auto`: what the model's sentence-transformers
        configuration declares (engine/pooling_config.py), else `last`."""
        self.ctx = ctx
        declared = ctx.engine.declared_pooling
        self.pooling = (declared or "last") if pooling == "auto" else pooling
        self.unsupported: str | None = None
        """Why no embedding is served: the model declares a pooling duet does not compute."""
        if self.pooling not in POOLING_TYPES:
            self.unsupported = (
                f"input: {ctx.model_name} declares {self.pooling!r} pooling (its "
                "sentence-transformers config), which this server does not compute; restart "
                f"it with --embedding-pooling {' or '.join(POOLING_TYPES)} to use another"
            )
            self.pooling = "last"
        self.params = SamplingParams(temperature=0.0, max_tokens=1, pooling=self.pooling)

    async def create(self, body: EmbeddingRequest, raw: Request) -> Response:
        self.ctx.check_model(body.model)
        request_id = f"embd-{uuid.uuid4().hex}"
        try:
            vectors, num_tokens = await run_until_disconnect(
                raw,
                self.embed(
                    body.inputs(), caller_api_key(raw), request_id, body.truncate_prompt_tokens
                ),
            )
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        width = len(vectors[0])
        if body.dimensions is not None and body.dimensions != width:
            raise BadRequestError(
                f"dimensions: this model's embeddings have {width} dimensions and cannot be "
                f"shortened; got {body.dimensions} (leave it out, or send {width})",
                param="dimensions",
            )
        data = [
            Embedding(index=i, embedding=_encode(v, body.encoding_format))
            for i, v in enumerate(vectors)
        ]
        usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        reply = EmbeddingResponse(data=data, model=self.ctx.model_name, usage=usage)
        return Response(reply.model_dump_json(), media_type="application/json")

    async def embed(
        self,
        inputs: Sequence[Prompt],
        api_key: str | None,
        request_id: str,
        truncate_prompt_tokens: int | None = None,
    ) -> tuple[list[list[float]], int]:
        """Each input's vector, in order, and the prompt tokens read: validated (a 400 naming
        `input`), cut to its last `truncate_prompt_tokens` when given (vLLM's), rate-limited
        for `api_key`, admitted, run. REST and gRPC both call this."""
        arrival_s = time.monotonic()
        ctx = self.ctx
        if self.unsupported is not None:
            raise BadRequestError(self.unsupported, param="input")
        if not ctx.engine.computes_embeddings:
            raise BadRequestError(
                "input: this server's engine does not compute embeddings (one that splits the "
                "model into pipeline stages does not yet)",
                param="input",
            )
        try:
            # A text to truncate may be longer than the context (the body's size bounds it).
            bounded = truncate_prompt_tokens is None
            prompts = [ctx.engine.tokenize_prompt(p, bounded)[1] for p in inputs] or [
                ctx.engine.tokenize_prompt([])[1]  # no input at all: the empty prompt's error
            ]
            # -1: as many as an embedding request takes, the context less the one token it
            # samples and drops.
            context = ctx.engine.max_model_len
            keep = context - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            prompts = [truncate_prompt(ids, keep, context) for ids in prompts]
            for ids in prompts:
                ctx.engine.check_lengths(len(ids), self.params)
        except InvalidInputError as e:
            raise BadRequestError.from_invalid_input(e, {"prompt": "input"}) from None
        ctx.check_engine()
        num_tokens = sum(len(ids) for ids in prompts)
        await ctx.rate_limiter.admit(api_key, num_tokens)
        tickets = ctx.admission.admit([1] * len(prompts))
        streams = [
            ctx.generate(ids, self.params, f"{request_id}-{i}", ticket, arrival_s)
            for i, (ids, ticket) in enumerate(zip(prompts, tickets, strict=True))
        ]
        try:
            finals = await final_outputs(streams)
        except Exception as e:
            raise as_openai_error(e, request_id) from e
        finally:
            for ticket in tickets:
                ticket.release()
        vectors = [out.embedding for out in finals]
        if any(v is None for v in vectors):
            raise RuntimeError("the engine ended an embedding request without its vector")
        return [v for v in vectors if v is not None], num_tokens


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
