"""Background chat requests: `"background": true` returns at once; any replica runs the request
from the work queue, and any replica serves its result and its stream.

- `POST /v1/chat/completions` with `"background": true` validates the request as usual (a 400
  at once for bad input), reads the session's history when `session_id` is given, enqueues a
  `background.chat` task and answers `{"id", "object": "chat.completion", "status": "queued",
  "choices": []}`.
- The runner runs the request as a chat turn (router/chat_turn.py) and appends each step of
  its events to the request's event log as they come. A delivery after a router died reads the
  log and continues from it (`TurnRequest.resume`), so the stream has no token missing or
  repeated. With a session, the turn is appended once when the request completes (a re-run
  that finds its own turn stored does not append it again).
- `GET /v1/chat/completions/{id}`: the completion with `"status": "completed"` (or `failed`
  with an error, or `queued`/`in_progress` with no choices yet).
- `GET /v1/chat/completions/{id}/events?offset=N` (or `Last-Event-ID: N-1`): SSE chunks from
  entry N of the log (the logged steps, rendered as interactive streams render them), each with
  `id: <offset>`, then `data: [DONE]`; a client whose router died reconnects to any replica
  with the last offset it saw plus one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from duet.router import sse
from duet.router.admission import AdmissionTicket, admit_queued
from duet.router.auth import caller_api_key
from duet.router.batches import NotFoundError, queue_errors
from duet.router.chat_events import Final, Finish, step_from_json, step_to_json
from duet.router.chat_turn import ChatTurns
from duet.router.errors import BadRequestError, OpenAIError, as_openai_error
from duet.router.openai_chat_render import ChatCompletionRender
from duet.router.openai_protocol import ChatCompletionRequest
from duet.router.openapi import error_responses
from duet.router.queue_worker import RetryTask
from duet.router.sessions import SessionTurn
from duet.router.sse import DONE, EventStreamResponse
from duet.session_store import Delivery, SessionStoreUnavailable, Task, WorkQueue, hash_api_key

KIND = "background.chat"
MAX_STREAM_S = 600.0
"""Longest one events request stays open; the client reconnects from its last offset."""
_POLL_S = 0.05


class BackgroundService:
    def __init__(self, queue: WorkQueue, turns: ChatTurns) -> None:
        self.queue = queue
        self.turns = turns
        self._runs = itertools.count()

    @property
    def model_name(self) -> str:
        return self.turns.ctx.model_name

    async def submit(self, body: ChatCompletionRequest, api_key: str | None) -> Response:
        for field, bad in (
            ("n", body.n != 1),
            ("prompt_logprobs", body.prompt_logprobs is not None),
            ("stream", body.stream),
        ):
            if bad:
                raise BadRequestError(
                    f"{field}: not supported with background (n must be 1, no prompt_logprobs; "
                    "stream the result from GET /v1/chat/completions/{id}/events)",
                    param=field,
                )
        rename = {"prompt": "messages", "max_tokens": body.max_tokens_field}
        plan, params = self.turns.plan(body, rename)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        # Validated, rendered and charged as an interactive turn is; it runs later, anywhere.
        turn = await self.turns.open(body, plan, params, api_key, request_id, rename, live=False)
        session = turn.request.session
        history = [] if session is None else session.history
        created = int(time.time())
        payload = {
            "body": body.model_dump(mode="json", exclude_unset=True),
            "messages": [*history, *turn.request.new_messages],
            "new_messages": turn.request.new_messages,
            "session": None if session is None else {"id": session.session_id,
                                                      "version": session.version},
            "created": created,
        }  # fmt: skip
        record = {"id": request_id, "owner": hash_api_key(api_key) or "", "created": created,
                  "logprobs": [bool(body.logprobs), body.top_logprobs or 0,
                               body.return_tokens_as_token_ids]}  # fmt: skip
        with queue_errors():
            await self.queue.enqueue(
                [Task(request_id, KIND, payload)], record=("background", request_id, record)
            )
        return JSONResponse(self._pending(request_id, created, "queued"))

    def _pending(self, request_id: str, created: int, status: str) -> dict[str, Any]:
        return {
            "id": request_id, "object": "chat.completion", "created": created,
            "model": self.model_name, "choices": [], "status": status,
        }  # fmt: skip

    # --- the runner (any replica's queue worker) ---

    async def run(self, delivery: Delivery) -> dict[str, Any]:
        """Run (or resume) the request; its result, an error result for a 4xx, `RetryTask`
        for what another delivery may get past (5xx, 429)."""
        p, request_id = delivery.payload, delivery.task_id
        body = ChatCompletionRequest.model_validate(p["body"])
        session = p["session"]
        turn_of_session = (
            None if session is None else SessionTurn(session["id"], session["version"], [])
        )
        # A fresh engine request id per run (a delivery runs again after an outage): an
        # earlier one may still be ending.
        engine_id = f"{request_id}-{delivery.num_deliveries}.{next(self._runs)}"
        try:
            plan, params = self.turns.plan(body, {})
            logged = [step_from_json(e) for e in await self._log(request_id)]
            turn = self.turns.rerun(
                body, plan, params, p["messages"], p["new_messages"], turn_of_session,
                request_id, engine_id, logged,
            )  # fmt: skip
        except OpenAIError as e:
            return _failed(e)
        offset, final = len(logged), None
        try:
            ticket = await self._admit() if turn.will_generate else None
            async with aclosing(turn.steps(ticket, time.monotonic())) as steps:
                async for step in steps:
                    final = step.first(Final)
                    if final is None:
                        offset = await self.queue.append_events(
                            request_id, offset, [step_to_json(step)]
                        )
        except SessionStoreUnavailable:
            raise
        except Exception as e:  # 409: another turn was stored first; 5xx, 429: retry
            error = as_openai_error(e, engine_id)
            if error.status_code >= 500 or error.status_code == 429:
                raise RetryTask(f"{error.status_code} {error.message}") from e
            return _failed(error)
        assert final is not None
        render = ChatCompletionRender.of(
            body, request_id, self.model_name, self.turns.ctx.token_texts, p["created"]
        )
        return {"response": render.response(final).model_dump(mode="json")}

    async def _admit(self) -> AdmissionTicket:
        return await admit_queued(self.turns.ctx.admission)

    async def _log(self, request_id: str, offset: int = 0) -> list[str]:
        return await self.queue.read_events(request_id, offset, 1 << 30)

    # --- reading (any replica) ---

    async def _record(self, api_key: str | None, request_id: str) -> dict[str, Any]:
        with queue_errors():
            doc = await self.queue.get_record("background", request_id)
        if doc is None or doc["owner"] != (hash_api_key(api_key) or ""):
            raise NotFoundError(
                f"completion_id: background request {request_id[:64]!r} not found",
                param="completion_id",
            )
        return doc

    async def retrieve(self, api_key: str | None, request_id: str) -> dict[str, Any]:
        doc = await self._record(api_key, request_id)
        with queue_errors():
            [result] = await self.queue.results([request_id])
            if result is None:
                started = await self.queue.read_events(request_id, 0, 1)
                return self._pending(
                    request_id, doc["created"], "in_progress" if started else "queued"
                )
        if "response" in result:
            return {**result["response"], "status": "completed"}
        return {**self._pending(request_id, doc["created"], "failed"), "error": result["error"]}

    async def stream(
        self, api_key: str | None, request_id: str, offset: int
    ) -> AsyncGenerator[str, None]:
        doc = await self._record(api_key, request_id)
        if offset < 0:
            raise BadRequestError(f"offset: must be >= 0; got {offset}", param="offset")
        return self._stream(request_id, doc, offset)

    async def _stream(
        self, request_id: str, doc: dict[str, Any], offset: int
    ) -> AsyncGenerator[str, None]:
        render = ChatCompletionRender(
            request_id, self.model_name, self.turns.ctx.token_texts, doc["created"],
            *doc.get("logprobs", ()),  # (logprobs, top_logprobs, as ids); older records: none
        )  # fmt: skip
        deadline = time.monotonic() + MAX_STREAM_S
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            if time.monotonic() - quiet_since >= sse.KEEPALIVE_S:
                quiet_since = time.monotonic()
                yield sse.KEEPALIVE
            try:
                raw = await self.queue.read_events(request_id, offset, 256)
                result = None if raw else (await self.queue.results([request_id]))[0]
            except SessionStoreUnavailable:
                await asyncio.sleep(0.5)  # Redis restarting: the log is still there after it
                continue
            for entry in raw:
                quiet_since = time.monotonic()
                step = step_from_json(entry)
                for chunk in render.chunks(step, keep_empty=True):  # one per entry: n is 1
                    yield f"id: {offset}\ndata: {chunk.model_dump_json()}\n\n"
                offset += 1
                if step.first(Finish) is not None:
                    yield DONE
                    return
            if result is not None and "error" in result:
                yield f"data: {json.dumps({'error': result['error']})}\n\n"
                return  # no [DONE] after an error: it would say the reply is whole
            if not raw:
                await asyncio.sleep(_POLL_S)
        message = f"stream open for {MAX_STREAM_S:g}s; reconnect with offset={offset}"
        yield f"data: {json.dumps({'error': {'code': 'reconnect', 'message': message}})}\n\n"


def _failed(error: OpenAIError) -> dict[str, Any]:
    body = error.to_body()["error"]
    return {"error": {"code": body["code"] or str(error.status_code), "message": body["message"]}}


def install_background_routes(app: FastAPI, service: BackgroundService) -> None:
    @app.get("/v1/chat/completions/{completion_id}", responses=error_responses(401, 404, 503))
    async def retrieve(completion_id: str, raw: Request) -> Response:
        return JSONResponse(await service.retrieve(caller_api_key(raw), completion_id))

    @app.get(
        "/v1/chat/completions/{completion_id}/events", responses=error_responses(400, 401, 404)
    )
    async def events(completion_id: str, raw: Request, offset: int | None = None) -> Response:
        if offset is None:
            last = raw.headers.get("last-event-id", "")
            offset = int(last) + 1 if last.isdigit() else 0
        stream = await service.stream(caller_api_key(raw), completion_id, offset)
        return EventStreamResponse(stream, lambda: None)
