"""Background responses (`"background": true` on `POST /v1/responses`): stored `queued` and
enqueued at once; any replica's queue worker runs the chat turn, marks the stored response
`in_progress`, and stores the finished one (or `failed`).

`POST /v1/responses/{id}/cancel` marks a queued or running response `cancelled` in the store;
the runner checks the store between engine steps (at most every `CANCEL_CHECK_S`), stops
generating (aborting the engine request) and never overwrites the cancelled response: every
write after the first is conditional on the stored status (`only_from`).

NOTE: unlike background chat completions, a re-delivered response (its router died) starts
over rather than resuming from a log; it has no event stream to keep seamless.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any

from duet.router.admission import AdmissionTicket, admit_queued
from duet.router.batches import queue_errors
from duet.router.chat_events import Final
from duet.router.chat_turn import ChatTurns
from duet.router.errors import OpenAIError, as_openai_error
from duet.router.openai_chat import assistant_message
from duet.router.openai_protocol import ChatCompletionRequest
from duet.router.queue_worker import RetryTask
from duet.router.responses_protocol import RESPONSES_RENAME
from duet.router.responses_render import ResponseRender, logprobs_render, token_counter
from duet.router.responses_store import RUNNING, StoredResponses
from duet.session_store import SessionStoreUnavailable, Task, WorkQueue

KIND = "background.response"
CANCEL_CHECK_S = 0.2
"""How often a running background response looks for its cancellation in the store."""


class ResponsesBackground:
    def __init__(self, queue: WorkQueue, turns: ChatTurns, stored: StoredResponses) -> None:
        self.queue = queue
        self.turns = turns
        self.stored = stored

    async def submit(
        self,
        chat: ChatCompletionRequest,
        render: ResponseRender,
        conversation: list[dict[str, Any]],
        owner: str | None,
    ) -> dict[str, Any]:
        """Store the response `queued` and enqueue its run; the queued response."""
        queued = render.response("queued")
        await self.stored.put(queued, [], owner)
        payload = {
            "chat": chat.model_dump(mode="json", by_alias=True, exclude_unset=True),
            "conversation": conversation,
            "owner": owner,
            "response": queued,
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
            return {"status": "cancelled"}
        chat = ChatCompletionRequest.model_validate(p["chat"])
        ctx = self.turns.ctx
        render = ResponseRender.resumed(running, token_counter(ctx.engine.tokenizer),
                                        logprobs_render(chat, ctx.token_texts))  # fmt: skip
        # A fresh engine request id per delivery: an earlier one may still be ending.
        engine_id = f"{response_id}-{delivery.num_deliveries}"
        try:
            plan, params = self.turns.plan(chat, RESPONSES_RENAME)
            messages = [m.to_template_message() for m in chat.messages]
            turn = self.turns.rerun(
                chat, plan, params, messages, [], None, response_id, engine_id, []
            )
            ticket = await self._admit()
            final = None
            async with aclosing(turn.steps(ticket, time.monotonic())) as steps:
                next_check = time.monotonic() + CANCEL_CHECK_S
                async for step in steps:
                    render.step(step)
                    final = step.first(Final) or final
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
        return {"status": done["status"] if stored else "cancelled"}

    async def _cancelled(self, response_id: str) -> bool:
        store = self.stored.sessions.store
        assert store is not None
        stored = await store.get_response(response_id)
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
