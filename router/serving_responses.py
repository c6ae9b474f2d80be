"""The Responses API: `POST /v1/responses` runs one chat turn (router/chat_turn.py) and renders
its events as a response (router/responses_render.py): one JSON object, or the typed SSE event
sequence with `stream`. `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}` and
`POST /v1/responses/{id}/cancel` (background responses) read the stored ones
(router/responses_store.py).

A stored response is written once its reply ended and before the event (or body) that says
so goes out, so a client that saw it complete can continue it by `previous_response_id`.
`"background": true` stores the response `queued` and enqueues it; any replica's queue worker
runs it (router/responses_background.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse

from duet.engine import InvalidInputError, SamplingParams
from duet.router.auth import caller_api_key
from duet.router.chat_events import ChatStep, Final
from duet.router.chat_turn import ChatTurns
from duet.router.conversations import ConversationsHandler
from duet.router.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, run_until_disconnect
from duet.router.errors import BadRequestError, as_openai_error
from duet.router.openai_chat import ChatPlan, assistant_message, template_reads
from duet.router.openai_fields import IGNORED_FIELDS_HEADER
from duet.router.openapi import error_responses
from duet.router.responses_background import ResponsesBackground, typed_sse_event
from duet.router.responses_protocol import (
    RESPONSES_RENAME,
    Includable,
    ResponsesRequest,
    input_item_messages,
)
from duet.router.responses_render import (
    ResponseRender,
    echo_fields,
    logprobs_render,
    new_id,
    token_counter,
)
from duet.router.responses_store import ENDED, RUNNING, StoredResponses
from duet.router.sse import SSE_EVENT_SCHEMA, EventStreamResponse
from duet.session_store import hash_api_key


class ResponsesHandler:
    def __init__(
        self,
        turns: ChatTurns,
        stored: StoredResponses,
        background: ResponsesBackground | None,
        conversations: ConversationsHandler,
    ) -> None:
        """`background`: runs `"background": true` responses; None: no work queue."""
        self.turns = turns
        self.stored = stored
        self.background = background
        self.conversations = conversations

    async def create(self, body: ResponsesRequest, raw: Request) -> Response:
        arrival_s = time.monotonic()
        ctx = self.turns.ctx
        api_key = caller_api_key(raw)
        ignored = body.ignored()
        effort = body.reasoning.effort if body.reasoning is not None else None
        if effort is not None and not template_reads(ctx.engine.tokenizer, "reasoning_effort"):
            ignored.append("reasoning.effort")
        store = body.store and self.stored.enabled
        if body.background and (self.background is None or not store):
            raise BadRequestError(
                "background: needs store (true) on a server with a work queue and a session store",
                param="background",
            )
        history: list[dict[str, Any]] = []
        owner = hash_api_key(api_key)
        conversation_id = body.conversation_id
        if conversation_id is not None:
            if body.previous_response_id is not None:
                raise BadRequestError(
                    "conversation: cannot be combined with previous_response_id",
                    param="conversation",
                )
            items = (await self.conversations.get(conversation_id, owner, "conversation")).doc
            history = input_item_messages(items["items"])
        if body.previous_response_id is not None:
            previous = await self.stored.get(
                body.previous_response_id, api_key, "previous_response_id"
            )
            history = previous.doc["messages"]
        new_messages = body.input_messages()
        chat = body.to_chat([*history, *new_messages])
        plan, params = self.turns.plan(chat, RESPONSES_RENAME)
        if body.truncation == "auto":
            chat = body.to_chat(self._fitting([*history, *new_messages], body, plan, params))
        response_id = new_id("resp")
        echo = echo_fields(body, ctx.model_name, store)
        render = ResponseRender(response_id, echo, token_counter(ctx.engine.tokenizer),
                                logprobs=logprobs_render(chat, ctx.token_texts))  # fmt: skip
        headers = {IGNORED_FIELDS_HEADER: ",".join(ignored)} if ignored else {}
        conversation = [*history, *new_messages]
        if body.background:
            assert self.background is not None
            # Validated, rendered and charged as an interactive turn is; it runs later, anywhere.
            await self.turns.open(
                chat, plan, params, api_key, response_id, RESPONSES_RENAME, live=False
            )
            turn_of = None if conversation_id is None else (conversation_id, body.input_items())
            queued = await self.background.submit(chat, render, conversation, owner, turn_of)
            if body.stream:
                events = await self.background.stream(response_id, api_key, None)
                return EventStreamResponse(events, lambda: None, headers)
            return JSONResponse(queued, headers=headers)
        turn = await self.turns.open(chat, plan, params, api_key, response_id, RESPONSES_RENAME)
        [ticket] = ctx.admission.admit([1])
        steps = turn.steps(ticket, arrival_s)

        async def save(final: Final) -> None:
            if conversation_id is not None and render.status in ENDED:
                await self.conversations.append_turn(
                    conversation_id, owner, response_id, body.input_items(), render.output
                )
            if store:
                reply = final.replies[0]
                message = assistant_message(reply.content, reply.tool_calls, reply.reasoning)
                await self.stored.put(render.response(), [*conversation, message], owner)

        if body.stream:
            events = _sse(render, steps, save)
            return EventStreamResponse(events, ticket.release, headers)
        try:
            final = await run_until_disconnect(raw, run_to_end(render, steps))
            await save(final)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as e:
            raise as_openai_error(e, response_id, RESPONSES_RENAME) from e
        finally:
            ticket.release()
        return JSONResponse(render.response(), headers=headers)

    def _fitting(
        self,
        messages: list[dict[str, Any]],
        body: ResponsesRequest,
        plan: ChatPlan,
        params: SamplingParams,
    ) -> list[dict[str, Any]]:
        """`truncation: "auto"`: the shortest cut of `messages` that fits the context with the
        reply's room (`check_lengths`), cut only before a user message, so every turn kept is
        whole (no tool result without its call). All of them when they fit; the last user
        turn when nothing shorter does (its 400 then says why)."""
        engine = self.turns.ctx.engine
        cuts = [0, *(i for i, m in enumerate(messages) if i and m.get("role") == "user")]

        def fits(start: int) -> bool:
            chat = body.to_chat(messages[start:])
            try:
                ids = plan.render(engine.tokenizer, chat,
                                  [m.to_template_message() for m in chat.messages])  # fmt: skip
                engine.check_lengths(len(ids), params)
            except InvalidInputError:
                return False
            return True

        if fits(0):  # the usual case: one render, no search
            return messages
        lo, hi = min(1, len(cuts) - 1), len(cuts) - 1  # the answer is in cuts[lo:hi + 1]
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(cuts[mid]):
                hi = mid
            else:
                lo = mid + 1
        return messages[cuts[lo] :]

    async def retrieve(
        self, response_id: str, raw: Request, stream: bool, starting_after: int | None
    ) -> Response:
        """The stored response; with `stream`, a background response's events again (after
        `starting_after`), from any replica."""
        api_key = caller_api_key(raw)
        if stream:
            if self.background is None:  # no work queue: nothing ran in the background
                raise BadRequestError(
                    "stream: needs a server with a work queue (background responses)",
                    param="stream",
                )
            events = await self.background.stream(response_id, api_key, starting_after)
            return EventStreamResponse(events, lambda: None)
        stored = await self.stored.get(response_id, api_key, "response_id")
        return JSONResponse(stored.doc["response"])

    async def cancel(self, response_id: str, raw: Request) -> dict[str, Any]:
        """A background response still queued or running becomes `cancelled` (its runner
        stops at its next step); one that already ended is returned as it is."""
        api_key = caller_api_key(raw)
        stored = await self.stored.get(response_id, api_key, "response_id")
        response = dict(stored.doc["response"])
        if not response.get("background"):
            raise BadRequestError(
                "response_id: only background responses can be cancelled", param="response_id"
            )
        if stored.status in RUNNING:
            cancelled = {**response, "status": "cancelled"}
            if await self.stored.put(cancelled, [], stored.api_key_hash, only_from=RUNNING):
                return cancelled
            stored = await self.stored.get(response_id, api_key, "response_id")  # it ended first
        return dict(stored.doc["response"])


async def run_to_end(render: ResponseRender, steps: AsyncGenerator[ChatStep, None]) -> Final:
    """Feed every step through `render` (the output items a stream would show); the turn's
    `Final`."""
    final = None
    async with aclosing(steps):
        async for step in steps:
            render.step(step)
            final = step.first(Final) or final
    if final is None:
        raise RuntimeError("the chat turn ended without its final event")
    render.closing(final)
    return final


async def _sse(
    render: ResponseRender, steps: AsyncGenerator[ChatStep, None], save: Any
) -> AsyncGenerator[str, None]:
    """The typed events; the response is stored before its terminal event. A failure ends the
    stream with an `error` event."""
    try:
        for event in render.opening():
            yield typed_sse_event(event)
        async with aclosing(steps):
            async for step in steps:
                final = step.first(Final)
                events = render.step(step)
                if final is not None:
                    events += render.closing(final)
                    await save(final)
                for event in events:
                    yield typed_sse_event(event)
    except Exception as e:  # the client gets an error event, never a silent cut
        error = as_openai_error(e, render.response_id, RESPONSES_RENAME)
        body = error.to_body()["error"]
        code = body["code"] or str(error.status_code)
        yield typed_sse_event(render.error_event(code, body["message"], body["param"]))


_RESPONSE = {"content": {"application/json": {"schema": {"type": "object"}}}}
_STREAMED = {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}}


def install_responses_routes(app: FastAPI, handler: ResponsesHandler) -> None:
    """`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`, `POST .../cancel`."""

    @app.post(
        "/v1/responses",
        response_model=None,
        responses={200: {"description": "A response, or its SSE events with stream",
                         "content": {**_RESPONSE["content"], **_STREAMED["content"]}},
                   **error_responses(400, 401, 404, 429, 503)},
    )  # fmt: skip
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        return await handler.create(body, raw)

    @app.get(
        "/v1/responses/{response_id}",
        response_model=None,
        responses={200: {"description": "The response, or a background one's SSE events with "
                                        "stream", "content": {**_RESPONSE["content"],
                                                              **_STREAMED["content"]}},
                   **error_responses(400, 401, 404, 503)},
    )  # fmt: skip
    async def get_response(
        response_id: str,
        raw: Request,
        stream: bool = False,
        starting_after: Annotated[int | None, Query(ge=0)] = None,
        include: Annotated[list[Includable] | None, Query()] = None,
        include_obfuscation: bool | None = None,
    ) -> Response:
        # What a response holds was fixed when it was created (its `include`); duet's streams
        # carry no obfuscation padding; `starting_after` places a stream.
        unused = {
            "include": bool(include),
            "include_obfuscation": bool(include_obfuscation),
            "starting_after": not stream and starting_after is not None,
        }
        ignored = [name for name, given in unused.items() if given]
        reply = await handler.retrieve(response_id, raw, stream, starting_after)
        if ignored:
            reply.headers[IGNORED_FIELDS_HEADER] = ",".join(ignored)
        return reply

    @app.delete("/v1/responses/{response_id}", responses=error_responses(401, 404, 503))
    async def delete_response(response_id: str, raw: Request) -> JSONResponse:
        await handler.stored.delete(response_id, caller_api_key(raw))
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.post("/v1/responses/{response_id}/cancel", responses=error_responses(400, 401, 404, 503))
    async def cancel_response(response_id: str, raw: Request) -> JSONResponse:
        return JSONResponse(await handler.cancel(response_id, raw))
