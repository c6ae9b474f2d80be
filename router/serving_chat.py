"""`POST /v1/chat/completions`: one chat turn (router/chat_turn.py) rendered in OpenAI's shape:
one JSON body, or SSE chunks when `stream` is true. `"background": true` hands the request to
the background service instead (router/background.py).

With `session_id`, the stored history comes before the request's messages, and the turn (the
request's messages and the reply) is stored before the reply is reported complete (see
`router.sessions`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing

from fastapi import Request, Response

from duet.router.auth import caller_api_key
from duet.router.background import BackgroundService
from duet.router.chat_events import ChatStep, Final, TokenDelta
from duet.router.chat_turn import ChatTurns, chat_rename, final_of
from duet.router.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, run_until_disconnect
from duet.router.errors import BadRequestError, as_openai_error
from duet.router.openai_chat import template_reads
from duet.router.openai_chat_render import ChatCompletionRender
from duet.router.openai_fields import IGNORED_FIELDS_HEADER, log_ignored
from duet.router.openai_protocol import ChatCompletionRequest
from duet.router.openai_responses import (
    ChatCompletionChunk,
    ChatCompletionStreamChoice,
    DeltaMessage,
    Usage,
)
from duet.router.sse import DONE, EventStreamResponse, sse_error, sse_event


class ChatCompletionHandler:
    def __init__(self, turns: ChatTurns, background: BackgroundService | None) -> None:
        """`background`: runs `"background": true` requests; None: no work queue."""
        self.turns = turns
        self.background = background

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        arrival_s = time.monotonic()
        ctx = self.turns.ctx
        api_key = caller_api_key(raw)
        rename = chat_rename(body)
        plan, params = self.turns.plan(body, rename)
        ignored = body.ignored()
        if body.reasoning_effort is not None and not template_reads(
            ctx.engine.tokenizer, "reasoning_effort", body.chat_template
        ):
            ignored.append("reasoning_effort")
        if body.prediction is not None and not ctx.engine.speculates_with_ngram:
            ignored.append("prediction")  # Predicted Outputs need ngram speculation
            log_ignored("POST /v1/chat/completions", ["prediction"])
        headers = {IGNORED_FIELDS_HEADER: ",".join(ignored)} if ignored else {}
        if body.background:
            if self.background is None:
                raise BadRequestError(
                    "background: not available (this server runs without a work queue)",
                    param="background",
                )
            queued = await self.background.submit(body, api_key)
            queued.headers.update(headers)
            return queued
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        turn = await self.turns.open(body, plan, params, api_key, request_id, rename)
        [ticket] = ctx.admission.admit([turn.n])
        steps = turn.steps(ticket, arrival_s)
        render = ChatCompletionRender.of(body, request_id, ctx.model_name, ctx.token_texts)
        if body.stream:
            num_prompt = len(turn.request.prompt_ids) if body.continuous_usage else None
            events = _sse(render, steps, turn.n, body.include_usage, rename, num_prompt)
            return EventStreamResponse(events, ticket.release, headers)
        try:
            final = await run_until_disconnect(raw, final_of(steps))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as e:
            raise as_openai_error(e, request_id, rename) from e
        finally:
            ticket.release()
        return Response(
            render.response(final).model_dump_json(), media_type="application/json",
            headers=headers,
        )  # fmt: skip


async def _sse(
    render: ChatCompletionRender,
    steps: AsyncGenerator[ChatStep, None],
    n: int,
    include_usage: bool,
    rename: dict[str, str],
    num_prompt_tokens: int | None = None,
) -> AsyncGenerator[str, None]:
    """SSE events: each choice's role, then the turn's chunks, the usage (when asked), and
    [DONE]; an error event instead of whatever a failure left out. `num_prompt_tokens` given:
    continuous usage stats, every chunk with the usage so far."""
    exclude = None if include_usage else {"usage"}
    num_completion = 0

    def event(chunk: ChatCompletionChunk) -> str:
        if num_prompt_tokens is not None and chunk.usage is None:
            chunk.usage = Usage.of(num_prompt_tokens, num_completion)
        if chunk.prompt_logprobs is None:  # only their own chunk carries them
            return sse_event(chunk, (exclude or set()) | {"prompt_logprobs"})
        return sse_event(chunk, exclude)

    try:
        for index in range(n):
            role = DeltaMessage(role="assistant", content="")
            yield event(render.chunk([ChatCompletionStreamChoice(index=index, delta=role)]))
        async with aclosing(steps):
            async for step in steps:
                num_completion += sum(
                    len(e.token_ids) for e in step.events if isinstance(e, TokenDelta)
                )
                for chunk in render.chunks(step):
                    yield event(chunk)
                final = step.first(Final)
                if final is not None and include_usage:
                    yield event(render.chunk([], usage=final.usage))
    except Exception as e:  # the client gets an error event, never a silent cut
        yield sse_error(e, render.request_id, rename)
        return  # NOTE: no [DONE]: it would say the reply is whole
    yield DONE
