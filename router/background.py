"""Background chat requests: `"background": true` returns at once; any replica runs the request
from the work queue, and any replica serves its result and its stream.

- `POST /v1/chat/completions` with `"background": true` validates the request as usual (a 400
  at once for bad input), reads the session's history when `session_id` is given, enqueues a
  `background.chat` task and answers `{"id", "object": "chat.completion", "status": "queued",
  "choices": []}`.
- The runner appends each output's new tokens to the request's event log (one entry per
  output: token ids, text, finish_reason) as they come. A delivery after a router died reads
  the log and continues generating from the prompt plus the tokens already logged, with the
  remaining budget, so the stream has no token missing or repeated. With a session, the turn
  is appended once when the request completes (a re-run that finds its own turn stored does not
  append it again).
- `GET /v1/chat/completions/{id}`: the completion with `"status": "completed"` (or `failed`
  with an error, or `queued`/`in_progress` with no choices yet).
- `GET /v1/chat/completions/{id}/events?offset=N` (or `Last-Event-ID: N-1`): SSE chunks from
  entry N of the log, each with `id: <offset>`, then `data: [DONE]`; a client whose router died
  reconnects to any replica with the last offset it saw plus one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from duet.engine import InvalidInputError
from duet.engine.tokenizer import IncrementalDetokenizer
from duet.router.admission import AdmissionTicket
from duet.router.auth import caller_api_key
from duet.router.background_tools import event_delta, rebuild_plan, replay, tool_fields
from duet.router.batch_runner import wait_out_overload
from duet.router.batches import NotFoundError, queue_errors
from duet.router.errors import BadRequestError, OpenAIError, SessionConflictError, as_openai_error
from duet.router.openai_chat import ChatPlan, assistant_message
from duet.router.openai_protocol import ChatCompletionRequest
from duet.router.openai_responses import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    DeltaMessage,
    Usage,
)
from duet.router.openapi import error_responses
from duet.router.queue_worker import RetryTask
from duet.router.serving_context import ServingContext
from duet.router.sessions import SessionTurn
from duet.router.sse import DONE, EventStreamResponse
from duet.session_store import Delivery, SessionStoreUnavailable, Task, WorkQueue, hash_api_key

KIND = "background.chat"
MAX_STREAM_S = 600.0
"""Longest one events request stays open; the client reconnects from its last offset."""
_POLL_S = 0.05


class BackgroundService:
    def __init__(self, queue: WorkQueue, ctx: ServingContext) -> None:
        self.queue = queue
        self.ctx = ctx

    async def submit(self, body: ChatCompletionRequest, api_key: str | None) -> Response:
        ctx = self.ctx
        for field, bad in (
            ("n", body.n != 1),
            ("logprobs", body.logprobs),
            ("prompt_logprobs", body.prompt_logprobs is not None),
            ("stream", body.stream),
        ):
            if bad:
                raise BadRequestError(
                    f"{field}: not supported with background (n must be 1, no logprobs; stream "
                    "the result from GET /v1/chat/completions/{id}/events)",
                    param=field,
                )
        rename = {"prompt": "messages", "max_tokens": body.max_tokens_field}
        try:
            params = body.to_sampling_params()
        except InvalidInputError as e:
            raise BadRequestError.from_invalid_input(e, rename) from None
        new_messages = [m.to_template_message() for m in body.messages]
        turn = None
        if body.session_id is not None:
            turn = await ctx.sessions.begin_turn(body.session_id, api_key)
        messages = new_messages if turn is None else [*turn.history, *new_messages]
        tools = tool_fields(body, ctx.chat_options)
        reply_start = None
        try:
            if tools is None:
                prompt_ids = ctx.engine.encode_chat(messages)
            else:
                plan = ChatPlan.of(body, ctx.chat_options, ctx.engine.tokenizer)
                prompt_ids = plan.render(ctx.engine.tokenizer, body, messages)
                params, reply_start = plan.sampling_params(params), plan.reply_start
        except InvalidInputError as e:
            raise BadRequestError.from_invalid_input(e, rename) from None
        max_tokens = ctx.check_lengths(len(prompt_ids), params, rename)
        await ctx.rate_limiter.admit(api_key, len(prompt_ids) + max_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        payload = {
            "body": body.model_dump(mode="json", exclude_unset=True),
            "messages": messages,
            "new_messages": new_messages,
            "session": None if turn is None else {"id": turn.session_id, "version": turn.version},
            "created": created,
            "tools": tools,
            "reply_start": reply_start,
        }
        record = {"id": request_id, "owner": hash_api_key(api_key) or "", "created": created,
                  "tools": tools, "reply_start": reply_start}  # fmt: skip
        with queue_errors():
            await self.queue.enqueue(
                [Task(request_id, KIND, payload)], record=("background", request_id, record)
            )
        return JSONResponse(self._pending(request_id, created, "queued"))

    def _pending(self, request_id: str, created: int, status: str) -> dict[str, Any]:
        return {
            "id": request_id, "object": "chat.completion", "created": created,
            "model": self.ctx.model_name, "choices": [], "status": status,
        }  # fmt: skip

    # --- the runner (any replica's queue worker) ---

    async def run(self, delivery: Delivery) -> dict[str, Any]:
        ctx, p, request_id = self.ctx, delivery.payload, delivery.task_id
        body = ChatCompletionRequest.model_validate(p["body"])
        plan = None
        try:
            params = body.to_sampling_params()
            if p.get("tools") is None:
                prompt_ids = ctx.engine.encode_chat(p["messages"])
            else:
                plan = self._plan(p, request_id)
                prompt_ids = plan.render(ctx.engine.tokenizer, body, p["messages"])
                params = plan.sampling_params(params)
            max_tokens = ctx.check_lengths(len(prompt_ids), params, {})
        except (InvalidInputError, OpenAIError) as e:
            return _failed(as_openai_error(e, request_id))
        events = await self._events(request_id)
        emitted = [t for e in events for t in e["token_ids"]]
        if not events or events[-1]["finish_reason"] is None:
            remaining = max_tokens - len(emitted)
            if remaining > 0:
                params = dataclasses.replace(
                    params,
                    max_tokens=remaining,
                    min_tokens=max(0, params.min_tokens - len(emitted)),
                )
                detok = None
                if emitted:  # a takeover: continue the text exactly where the log ends
                    detok = IncrementalDetokenizer(
                        ctx.engine.tokenizer, prompt_ids, params.skip_special_tokens
                    )
                    for token_id in emitted:
                        detok.add_token(token_id)
                    detok.text = detok.text[len("".join(e["text"] for e in events)) :]
                failure = await self._generate(
                    delivery, prompt_ids + emitted, params, len(events), detok
                )
                if failure is not None:
                    return failure
            else:
                await self.queue.append_events(
                    request_id, len(events), [json.dumps(_event([], "", "length"))]
                )
            events = await self._events(request_id)
        text = "".join(e["text"] for e in events)
        num_tokens = sum(len(e["token_ids"]) for e in events)
        message = ChatResponseMessage(content=text)
        finish_reason = events[-1]["finish_reason"]
        if plan is not None:  # the calls the events route streamed, under the same ids
            reply = plan.new_reply()
            piece, content, calls = reply.whole(text)
            message = ChatResponseMessage(
                content=content, reasoning_content=piece.reasoning or None, tool_calls=calls
            )
            finish_reason = reply.finish_reason(finish_reason)
        if p["session"] is not None:
            m = message
            try:
                await self._commit_turn(
                    p, assistant_message(m.content, m.tool_calls, m.reasoning_content)
                )
            except OpenAIError as e:  # 409: another turn was stored first; 503: retry
                if e.status_code >= 500:
                    raise RetryTask(f"{e.status_code} {e.message}") from e
                return _failed(e)
        response = ChatCompletionResponse(
            id=request_id,
            created=p["created"],
            model=ctx.model_name,
            choices=[ChatCompletionChoice(index=0, message=message, finish_reason=finish_reason)],
            usage=Usage.of(len(prompt_ids), num_tokens),
        )
        return {"response": response.model_dump(mode="json")}

    async def _generate(
        self,
        delivery: Delivery,
        prompt_ids: list[int],
        params: Any,
        offset: int,
        detok: IncrementalDetokenizer | None,
    ) -> dict[str, Any] | None:
        """Generate and log each output; an error result for a 4xx, RetryTask for the rest.

        `detok`: after a takeover, a detokenizer replayed over the logged tokens, whose `text`
        holds what the log lacks (bytes of a character still incomplete, text held back).
        NOTE: the engine's own text deltas would restart at the continuation's prompt and
        drop a character split across the takeover."""
        ctx = self.ctx
        engine_id = f"{delivery.task_id}-{delivery.num_deliveries}"

        async def admit() -> AdmissionTicket:
            [ticket] = ctx.admission.admit([1])
            return ticket

        try:
            ticket = await wait_out_overload(admit)
        except OpenAIError as e:
            raise RetryTask(f"{e.status_code} {e.message}") from e
        try:
            outputs = ctx.generate(prompt_ids, params, engine_id, ticket, time.monotonic())
            async with aclosing(outputs) as it:  # leaving early aborts the engine request
                async for out in it:
                    c = out.outputs[0]
                    if not c.delta_token_ids and c.finish_reason is None:
                        continue
                    text = c.delta_text
                    if detok is not None:
                        pending, detok.text = detok.text, ""
                        text = pending + "".join(detok.add_token(t) for t in c.delta_token_ids)
                        detok.text = ""
                    event = _event(list(c.delta_token_ids), text, c.finish_reason)
                    offset = await self.queue.append_events(
                        delivery.task_id, offset, [json.dumps(event)]
                    )
        except SessionStoreUnavailable:
            raise
        except Exception as e:
            error = as_openai_error(e, engine_id)
            if error.status_code >= 500 or error.status_code == 429:
                raise RetryTask(f"{error.status_code} {error.message}") from e
            return _failed(error)
        finally:
            ticket.release()
        return None

    def _plan(self, stored: dict[str, Any], request_id: str) -> ChatPlan:
        """The tool plan a request with tools was submitted with (`background_tools`)."""
        tokenizer = self.ctx.engine.tokenizer
        options = self.ctx.chat_options
        return rebuild_plan(stored["tools"], stored["reply_start"], options, tokenizer, request_id)

    async def _commit_turn(self, payload: dict[str, Any], reply: dict[str, Any]) -> None:
        session = payload["session"]
        turn = SessionTurn(session["id"], session["version"], [])
        try:
            await self.ctx.sessions.commit_turn(turn, payload["new_messages"], reply)
        except SessionConflictError:
            # A re-run after this turn was stored (before its result was): not again.
            history = await self.ctx.sessions.store.history(turn.session_id)  # type: ignore[union-attr]
            mine = [*payload["new_messages"], reply]
            if history[-len(mine) :] != mine:
                raise

    async def _events(self, request_id: str, offset: int = 0) -> list[dict[str, Any]]:
        raw = await self.queue.read_events(request_id, offset, 1 << 30)
        return [json.loads(e) for e in raw]

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
        created, reply = doc["created"], None
        if doc.get("tools") is not None:  # the log's raw text -> content and tool-call deltas
            reply = self._plan(doc, request_id).new_reply()
            replay(reply, (await self._events(request_id))[:offset] if offset else [])
        deadline = time.monotonic() + MAX_STREAM_S
        while time.monotonic() < deadline:
            try:
                raw = await self.queue.read_events(request_id, offset, 256)
                result = None if raw else (await self.queue.results([request_id]))[0]
            except SessionStoreUnavailable:
                await asyncio.sleep(0.5)  # Redis restarting: the log is still there after it
                continue
            for entry in raw:
                event = json.loads(entry)
                delta, finish_reason = DeltaMessage(content=event["text"] or None), None
                if reply is not None:
                    delta, finish_reason = event_delta(reply, event)
                choice = ChatCompletionStreamChoice(
                    index=0, delta=delta, finish_reason=finish_reason or event["finish_reason"]
                )
                chunk = ChatCompletionChunk(
                    id=request_id, created=created, model=self.ctx.model_name, choices=[choice]
                )
                yield f"id: {offset}\ndata: {chunk.model_dump_json()}\n\n"
                offset += 1
                if event["finish_reason"] is not None:
                    yield DONE
                    return
            if result is not None and "error" in result:
                yield f"data: {json.dumps({'error': result['error']})}\n\n"
                yield DONE
                return
            if not raw:
                await asyncio.sleep(_POLL_S)
        message = f"stream open for {MAX_STREAM_S:g}s; reconnect with offset={offset}"
        yield f"data: {json.dumps({'error': {'code': 'reconnect', 'message': message}})}\n\n"


def _event(token_ids: list[int], text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"token_ids": token_ids, "text": text, "finish_reason": finish_reason}


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
