"""Background responses (`"background": true` on `POST /v1/responses`): stored `queued` and
enqueued at once; any replica's queue worker runs the chat turn, marks the stored response
`in_progress`, appends each engine step's events to the response's event log (the work
queue's, as background chat requests do), and stores the finished one (or `failed`). A
delivery after a router died reads the log and continues from it (`TurnRequest.resume`), so
the reply has no token missing or repeated. With `conversation`, the turn joins the stored
conversation once the response ended (completed or incomplete): once, however many
deliveries it took (`ConversationsHandler.append_turn` records the response id).

Streaming (`"stream": true` with `background`, and `GET /v1/responses/{id}?stream=true
&starting_after=N` on any replica, while the work queue keeps the log): the events are
rendered again from the log by a fresh `ResponseRender`, which gives every render of the same
steps the same events, sequence numbers and item ids; `response.created` and
`response.queued`, `response.in_progress` once a worker runs it, the output's events, then
the terminal event carrying the response as stored. A client whose connection dropped
reconnects with the last `sequence_number` it saw.

`POST /v1/responses/{id}/cancel` marks a queued or running response `cancelled` in the store;
the runner checks the store between engine steps (at most every `CANCEL_CHECK_S`), stops
generating (aborting the engine request) and never overwrites the cancelled response: every
write after the first is conditional on the stored status (`only_from`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from duet.router import sse
from duet.router.admission import AdmissionTicket, admit_queued
from duet.router.batches import queue_errors
from duet.router.chat_events import Final, step_from_json, step_to_json
from duet.router.chat_turn import ChatTurns
from duet.router.conversations import ConversationsHandler
from duet.router.errors import BadRequestError, OpenAIError, as_openai_error
from duet.router.logprobs import response_logprobs
from duet.router.openai_chat import assistant_message
from duet.router.openai_protocol import ChatCompletionRequest
from duet.router.queue_worker import RetryTask
from duet.router.responses_protocol import RESPONSES_RENAME
from duet.router.responses_render import ResponseRender, logprobs_render, token_counter
from duet.router.responses_store import ENDED, RUNNING, StoredResponses
from duet.session_store import SessionStoreUnavailable, StoredResponse, Task, WorkQueue

logger = logging.getLogger(__name__)

KIND = "background.response"
CANCEL_CHECK_S = 0.2
"""How often a running background response looks for its cancellation in the store."""
MAX_STREAM_S = 600.0
"""Longest one stream of a background response stays open; the client reconnects with
`starting_after`."""
_POLL_S = 0.05


class ResponsesBackground:
    def __init__(
        self,
        queue: WorkQueue,
        turns: ChatTurns,
        stored: StoredResponses,
        conversations: ConversationsHandler,
    ) -> None:
        self.queue = queue
        self.turns = turns
        self.stored = stored
        self.conversations = conversations

    async def submit(
        self,
        chat: ChatCompletionRequest,
        render: ResponseRender,
        conversation: list[dict[str, Any]],
        owner: str | None,
        turn_of: tuple[str, list[dict[str, Any]]] | None = None,
    ) -> dict[str, Any]:
        """Store the response `queued` and enqueue its run; the queued response. `turn_of`:
        the stored conversation (`conversation`) its turn joins once it ends, and the turn's
        input items."""
        queued = render.response("queued")
        await self.stored.put(queued, [], owner)
        payload = {
            "chat": chat.model_dump(mode="json", by_alias=True, exclude_unset=True),
            "conversation": conversation,
            "owner": owner,
            "response": queued,
            "turn_of": None if turn_of is None else list(turn_of),
        }
        with queue_errors():
            await self.queue.enqueue([Task(queued["id"], KIND, payload)])
        return queued

    async def run(self, delivery: Any) -> dict[str, Any]:
        """The queue worker's runner: the response's turn, stored as it ends."""
        p, response_id = delivery.payload, delivery.task_id
        owner, conversation = p["owner"], p["conversation"]
        running = {**p["response"], "status": "in_progress"}
        if not await self.stored.put(running, [], owner, only_from=RUNNING):
            # Cancelled, or it ended on an earlier delivery, which may have died before its
            # turn joined the conversation (joining twice adds nothing).
            ended = await self._current(response_id)
            if ended is None or ended.status not in ENDED:
                return {"status": "cancelled"}
            await self._join(p, owner, ended.doc["response"])
            return {"status": ended.status}
        chat = ChatCompletionRequest.model_validate(p["chat"])
        ctx = self.turns.ctx
        render = ResponseRender.resumed(running, token_counter(ctx.engine.tokenizer),
                                        logprobs_render(chat, ctx.token_texts))  # fmt: skip
        # A fresh engine request id per delivery: an earlier one may still be ending.
        engine_id = f"{response_id}-{delivery.num_deliveries}"
        try:
            plan, params = self.turns.plan(chat, RESPONSES_RENAME)
            messages = [m.to_template_message() for m in chat.messages]
            logged = [step_from_json(e) for e in await self._log(response_id)]
            for step in logged:  # what an earlier delivery ran: its output items, its ids
                render.step(step)
            turn = self.turns.rerun(
                chat, plan, params, messages, [], None, response_id, engine_id, logged
            )
            ticket = await self._admit() if turn.will_generate else None
            final, offset = None, len(logged)
            async with aclosing(turn.steps(ticket, time.monotonic())) as steps:
                next_check = time.monotonic() + CANCEL_CHECK_S
                async for step in steps:
                    render.step(step)
                    final = step.first(Final) or final
                    if final is None:
                        offset = await self.queue.append_events(
                            response_id, offset, [step_to_json(step)]
                        )
                    if final is None and time.monotonic() >= next_check:
                        next_check = time.monotonic() + CANCEL_CHECK_S
                        if await self._cancelled(response_id):
                            return {"status": "cancelled"}  # leaving aborts the engine request
        except SessionStoreUnavailable:
            raise
        except RetryTask:
            raise
        except Exception as e:
            error = as_openai_error(e, engine_id, RESPONSES_RENAME)
            if error.status_code >= 500 or error.status_code == 429:
                raise RetryTask(f"{error.status_code} {error.message}") from e
            return await self._failed(render, owner, error)
        assert final is not None
        render.closing(final)
        reply = final.replies[0]
        message = assistant_message(reply.content, reply.tool_calls, reply.reasoning)
        done = render.response()
        stored = await self.stored.put(
            done, [*conversation, message], owner, only_from={"in_progress"}
        )
        if not stored:
            return {"status": "cancelled"}
        if done["status"] in ENDED:
            await self._join(p, owner, done)
        return {"status": done["status"]}

    async def _join(self, payload: dict[str, Any], owner: str | None, done: dict[str, Any]) -> None:
        """The ended response's turn onto its conversation, if it names one. A conversation
        deleted meanwhile (a 404) leaves the response as it is; a store that fails is retried
        with the delivery (a 5xx)."""
        if payload.get("turn_of") is None:
            return
        conversation_id, inputs = payload["turn_of"]
        try:
            await self.conversations.append_turn(
                conversation_id, owner, done["id"], inputs, done["output"]
            )
        except OpenAIError as e:
            if e.status_code >= 500:  # the store: the next delivery joins it (once)
                raise RetryTask(f"{e.status_code} {e.message}") from e
            # e.g. a conversation deleted meanwhile (404): the response stands alone
            logger.warning(
                "response %s: its turn cannot join conversation %s: %s",
                done["id"], conversation_id, e.message,
            )  # fmt: skip

    async def _current(self, response_id: str) -> StoredResponse | None:
        """The response as stored now (the runner's and the stream's own reads: the caller's
        ownership was checked when it asked)."""
        store = self.stored.sessions.store
        assert store is not None, "a background response is stored"
        return await store.get_response(response_id)

    async def _cancelled(self, response_id: str) -> bool:
        stored = await self._current(response_id)
        return stored is None or stored.status == "cancelled"

    async def _failed(
        self, render: ResponseRender, owner: str | None, error: OpenAIError
    ) -> dict[str, Any]:
        failed = render.response(
            "failed", error={"code": "invalid_prompt", "message": error.message}
        )
        await self.stored.put(failed, [], owner, only_from={"in_progress"})
        return {"status": "failed"}

    async def _admit(self) -> AdmissionTicket:
        return await admit_queued(self.turns.ctx.admission)

    async def _log(self, response_id: str, offset: int = 0) -> list[str]:
        return await self.queue.read_events(response_id, offset, 1 << 30)

    # --- streaming (any replica) ---

    async def stream(
        self, response_id: str, api_key: str | None, starting_after: int | None
    ) -> AsyncGenerator[str, None]:
        """The SSE events of the caller's background response after `starting_after` (all of
        them when None); 404 for another's or an unknown one, 400 for one that did not run in
        the background (its events were never logged)."""
        stored = await self.stored.get(response_id, api_key, "response_id")
        if not stored.doc["response"].get("background"):
            raise BadRequestError(
                "stream: only a background response can be streamed again", param="stream"
            )
        if starting_after is not None and starting_after < 0:
            raise BadRequestError(
                f"starting_after: must be >= 0; got {starting_after}", param="starting_after"
            )
        return self._stream(
            stored.doc["response"], -1 if starting_after is None else starting_after
        )

    async def _stream(self, response: dict[str, Any], after: int) -> AsyncGenerator[str, None]:
        response_id = response["id"]
        texts = self.turns.ctx.token_texts
        top = response.get("top_logprobs") or 0
        render = ResponseRender.resumed(
            response, token_counter(self.turns.ctx.engine.tokenizer),
            lambda entries: response_logprobs(entries, top, texts),  # logged only when asked
        )  # fmt: skip
        # Every replay gives the same sequence: created, queued, in_progress (at the first
        # sign of a run, or at the end), the logged steps' events, the terminal event.
        pending, offset, started = render.queued_opening(), 0, False
        deadline = time.monotonic() + MAX_STREAM_S
        quiet_since = time.monotonic()
        while True:
            for event in pending:
                if event["sequence_number"] > after:
                    after = event["sequence_number"]
                    quiet_since = time.monotonic()
                    yield typed_sse_event(event)
            pending = []
            if time.monotonic() - quiet_since >= sse.KEEPALIVE_S:
                quiet_since = time.monotonic()
                yield sse.KEEPALIVE
            if time.monotonic() >= deadline:
                message = (
                    f"stream open for {MAX_STREAM_S:g}s; reconnect with starting_after={after}"
                )
                yield typed_sse_event(render.error_event("reconnect", message, None))
                return
            try:
                raw = await self.queue.read_events(response_id, offset, 256)
                stored = None if raw else await self._current(response_id)
                ended = stored is not None and stored.status not in RUNNING
                if ended:
                    # The runner logs every step before it stores the end: the log's
                    # entries appended since the read above, then the end.
                    raw = await self._log(response_id, offset)
            except SessionStoreUnavailable:
                await asyncio.sleep(0.5)  # a store restarting: the log is still there after it
                continue
            if stored is None and not raw:  # deleted while streaming
                yield typed_sse_event(
                    render.error_event("not_found", "the response was deleted", None)
                )
                return
            if not started and (raw or ended or (stored and stored.status == "in_progress")):
                pending.append(render.started())
                started = True
            for entry in raw:
                pending += render.step(step_from_json(entry))
            offset += len(raw)
            if ended:
                assert stored is not None
                pending += render.ended(stored.doc["response"])
                for event in pending:
                    if event["sequence_number"] > after:
                        yield typed_sse_event(event)
                return
            if not raw:
                await asyncio.sleep(_POLL_S)


def typed_sse_event(event: dict[str, Any]) -> str:
    """One Responses API event as SSE (its type on the `event:` line)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
