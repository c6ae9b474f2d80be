"""`POST /v1/chat/completions`: render the chat template, generate, answer in OpenAI's shape
(one JSON body, or SSE chunks when `stream` is true).

With `session_id`, the stored history comes before the request's messages, and the turn (the
request's messages and the reply) is stored before the reply is reported complete (see
`router.sessions`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from fastapi import Request, Response

from duet.engine import CompletionOutput, InvalidInputError, RequestOutput
from duet.router.auth import caller_api_key
from duet.router.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, run_until_disconnect
from duet.router.errors import BadRequestError, as_openai_error
from duet.router.logprobs import chat_logprobs, prompt_logprobs
from duet.router.openai_chat import ChatPlan, assistant_message, reply_message
from duet.router.openai_protocol import ChatCompletionRequest
from duet.router.openai_responses import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
    PromptLogprobs,
    Usage,
)
from duet.router.serving_context import ServingContext, final_output
from duet.router.sessions import SessionTurn
from duet.router.sse import DONE, EventStreamResponse, sse_error, sse_event
from duet.router.tool_stream import Piece

if TYPE_CHECKING:
    from duet.router.background import BackgroundService


class ChatCompletionHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.background: BackgroundService | None = None
        """Runs `"background": true` requests; None: the server has no work queue."""

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        arrival_s = time.monotonic()
        ctx = self.ctx
        ctx.check_model(body.model)
        api_key = caller_api_key(raw)
        # Engine field names -> this request's names, so a 400 names what the client sent.
        rename = {
            "prompt": "messages",
            "max_tokens": body.max_tokens_field,
            "logprobs": "top_logprobs",
        }
        try:
            plan = ChatPlan.of(body, ctx.chat_options, ctx.engine.tokenizer)
            params = body.to_sampling_params()
        except InvalidInputError as e:
            raise BadRequestError.from_invalid_input(e, rename) from None
        if body.background:
            if self.background is None:
                raise BadRequestError(
                    "background: not available (this server runs without a work queue)",
                    param="background",
                )
            return await self.background.submit(body, api_key)
        new_messages = [m.to_template_message() for m in body.messages]
        turn: SessionTurn | None = None
        if body.session_id is not None:
            if params.n != 1:
                raise BadRequestError(
                    f"n: must be 1 with session_id (a session stores one reply per turn); "
                    f"got {params.n}",
                    param="n",
                )
            turn = await ctx.sessions.begin_turn(body.session_id, api_key)
        messages = new_messages if turn is None else [*turn.history, *new_messages]
        try:
            prompt_ids = plan.render(ctx.engine.tokenizer, body, messages)
            params = plan.sampling_params(params)
        except InvalidInputError as e:
            raise BadRequestError.from_invalid_input(e, rename) from None
        max_tokens = ctx.check_lengths(len(prompt_ids), params, rename)
        ctx.check_priority(body.priority)
        ctx.check_engine()
        await ctx.rate_limiter.admit(api_key, len(prompt_ids) + max_tokens * params.n)
        [ticket] = ctx.admission.admit([params.n])
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = ctx.generate(prompt_ids, params, request_id, ticket, arrival_s, body.priority)
        if body.stream:
            events = self._stream(
                body, plan, request_id, params.n, outputs, rename, turn, new_messages
            )
            return EventStreamResponse(events, ticket.release)
        try:
            final = await run_until_disconnect(raw, final_output(outputs))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as e:
            raise as_openai_error(e, request_id, rename) from e
        finally:
            ticket.release()
        response = self._response(body, plan, request_id, final)
        if turn is not None:
            m = response.choices[0].message
            reply = assistant_message(m.content, m.tool_calls, m.reasoning_content)
            await ctx.sessions.commit_turn(turn, new_messages, reply)
        return Response(response.model_dump_json(), media_type="application/json")

    def _logprobs(
        self, body: ChatCompletionRequest, c: CompletionOutput, num_new: int | None = None
    ) -> ChatLogprobs | None:
        """Logprobs of the sample's last `num_new` tokens (all of them when None)."""
        if not body.logprobs or c.logprobs is None:
            return None
        entries = c.logprobs if num_new is None else c.logprobs[len(c.logprobs) - num_new :]
        return chat_logprobs(
            entries, body.top_logprobs or 0, self.ctx.token_texts, body.return_tokens_as_token_ids
        )

    def _response(
        self, body: ChatCompletionRequest, plan: ChatPlan, request_id: str, final: RequestOutput
    ) -> ChatCompletionResponse:
        choices = []
        for c in final.outputs:
            reply = plan.new_reply()
            piece, content, tool_calls = reply.whole(c.text)
            message = ChatResponseMessage(
                content=content, reasoning_content=piece.reasoning or None, tool_calls=tool_calls
            )
            choices.append(
                ChatCompletionChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(body, c),
                    finish_reason=reply.finish_reason(c.finish_reason),
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=self.ctx.model_name,
            choices=choices,
            usage=_usage(final),
            prompt_logprobs=self._prompt_logprobs(body, final),
        )

    def _prompt_logprobs(
        self, body: ChatCompletionRequest, out: RequestOutput
    ) -> PromptLogprobs | None:
        if body.prompt_logprobs is None:
            return None
        texts = self.ctx.token_texts
        return prompt_logprobs(out.prompt_logprobs, texts, body.return_tokens_as_token_ids)

    async def _stream(
        self,
        body: ChatCompletionRequest,
        plan: ChatPlan,
        request_id: str,
        n: int,
        outputs: AsyncGenerator[RequestOutput, None],
        rename: dict[str, str],
        turn: SessionTurn | None,
        new_messages: list[dict[str, Any]],
    ) -> AsyncGenerator[str, None]:
        """SSE events. With a session, the last content chunk (the one with finish_reason) and
        the usage chunk wait until the turn is stored; if storing fails, an error event takes
        their place."""
        created = int(time.time())
        exclude = None if body.include_usage else {"usage"}

        def chunk(
            choices: list[ChatCompletionStreamChoice],
            usage: Usage | None = None,
            prompt_lps: PromptLogprobs | None = None,
        ) -> str:
            payload = ChatCompletionChunk(
                id=request_id,
                created=created,
                model=self.ctx.model_name,
                choices=choices,
                usage=usage,
                prompt_logprobs=prompt_lps,
            )
            if prompt_lps is None:  # only the first output's chunk carries them
                return sse_event(payload, (exclude or set()) | {"prompt_logprobs"})
            return sse_event(payload, exclude)

        try:
            for index in range(n):
                role = DeltaMessage(role="assistant", content="")
                yield chunk([ChatCompletionStreamChoice(index=index, delta=role)])
            finished: set[int] = set()
            replies = {index: plan.new_reply() for index in range(n)}
            held: list[str] = []
            pieces: list[Piece] = []  # choice 0's, which a session stores
            last: RequestOutput | None = None
            async with aclosing(outputs) as it:
                async for out in it:
                    if last is None and body.prompt_logprobs is not None:
                        yield chunk([], prompt_lps=self._prompt_logprobs(body, out))
                    last = out
                    for c in out.outputs:
                        if c.index in finished:
                            continue
                        reply = replies[c.index]
                        piece = reply.feed(c.delta_text)
                        if c.finish_reason is not None:
                            finished.add(c.index)
                            piece = piece.then(reply.finish())
                        logprobs = self._logprobs(body, c, len(c.delta_token_ids))
                        if logprobs is not None and not logprobs.content:
                            logprobs = None
                        if piece.is_empty and logprobs is None and c.finish_reason is None:
                            continue  # text held back (maybe a stop string or a marker)
                        if c.index == 0:
                            pieces.append(piece)
                        delta = DeltaMessage(
                            content=piece.content or None,
                            reasoning_content=piece.reasoning or None,
                            tool_calls=piece.tool_calls or None,
                        )
                        choice = ChatCompletionStreamChoice(
                            index=c.index,
                            delta=delta,
                            logprobs=logprobs,
                            finish_reason=reply.finish_reason(c.finish_reason),
                            stop_reason=c.stop_reason,
                        )
                        if turn is not None and c.finish_reason is not None:
                            held.append(chunk([choice]))
                        else:
                            yield chunk([choice])
            if turn is not None and last is not None:
                await self.ctx.sessions.commit_turn(turn, new_messages, reply_message(pieces))
            for event in held:
                yield event
            if body.include_usage and last is not None:
                yield chunk([], usage=_usage(last))
        except Exception as e:  # the client gets an error event, never a silent cut
            yield sse_error(e, request_id, rename)
        yield DONE


def _usage(out: RequestOutput) -> Usage:
    return Usage.of(
        len(out.prompt_token_ids),
        sum(len(c.token_ids) for c in out.outputs),
        out.num_cached_tokens,
    )
