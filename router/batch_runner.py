"""Running one batch line: the same handlers as interactive requests, at a lower priority.

A chat line runs as the same chat turn as `POST /v1/chat/completions` (router/chat_turn.py),
a completion line through `CompletionHandler` and an embedding line through `EmbeddingHandler`,
so validation, length checks and the response body are exactly those of the endpoints. Batch lines skip per-key rate limits (as OpenAI's batch queue has its
own limits) and sessions (rejected at upload).

Priority: `BatchPriority.free_slots` lets batch lines take engine slots only while interactive
traffic leaves them free, keeping `reserved_fraction` of the running slots for interactive
requests and never running more than `max_fraction` of them as batch work. A running line is
not preempted; an interactive request arriving meanwhile queues behind at most those lines.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.types import Message

from duet.router.admission import AdmissionController, wait_out_overload
from duet.router.batches import BatchService
from duet.router.chat_turn import ChatTurns, chat_rename, final_of
from duet.router.embeddings_protocol import EmbeddingRequest
from duet.router.errors import OpenAIError, as_openai_error
from duet.router.openai_chat_render import ChatCompletionRender
from duet.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from duet.router.queue_worker import RetryTask, TaskRunner
from duet.router.rate_limit import NO_RATE_LIMITS, RequestRateLimiter
from duet.router.serving_completion import CompletionHandler
from duet.router.serving_context import ServingContext
from duet.router.serving_embeddings import EmbeddingHandler
from duet.router.sessions import SessionManager
from duet.session_store import Delivery

CANCEL_CHECK_S = 1.0
"""How stale a line's view of its batch's cancellation may be."""


@dataclass(frozen=True)
class BatchPriority:
    """How much of the engine batch work may use (fractions of its running slots)."""

    max_fraction: float = 0.5
    """At most this share of the running slots runs batch lines."""
    reserved_fraction: float = 0.25
    """This share of the running slots is kept free for interactive requests."""
    shared_fraction: float = 0.125
    """While interactive requests run, new batch lines start only below this share of the
    running slots (at least one; at most `max_fraction`): every batch line shares each decode
    step with them.
    Measured at 0.5 (2026-11-25, docs/queue.md): interactive TTFT p90 1.57x and ITL 2.4x."""

    def __post_init__(self) -> None:
        if not 0 < self.max_fraction <= 1:
            raise ValueError(f"max_fraction: must be in (0, 1]; got {self.max_fraction}")
        if not 0 < self.shared_fraction <= 1:
            raise ValueError(f"shared_fraction: must be in (0, 1]; got {self.shared_fraction}")
        if not 0 <= self.reserved_fraction < 1:
            raise ValueError(f"reserved_fraction: must be in [0, 1); got {self.reserved_fraction}")

    def free_slots(self, admission: AdmissionController, num_batch_running: int) -> int:
        """How many more batch lines may start now."""
        max_running = admission.max_running
        # NOTE: each running line holds at least one admitted sequence; the rest is interactive.
        num_interactive = max(0, admission.num_in_flight - num_batch_running)
        shared = min(self.shared_fraction, self.max_fraction)
        fraction = shared if num_interactive else self.max_fraction
        cap = max(1, int(max_running * fraction))
        room = max_running - int(max_running * self.reserved_fraction) - num_interactive
        return max(0, min(cap, room) - num_batch_running)


async def _never_disconnects() -> Message:
    # The queue, not a client, waits for this result: nobody can go away. The handler cancels
    # this wait once the result is in.
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def _internal_request() -> Request:
    scope: dict[str, Any] = {
        "type": "http", "method": "POST", "path": "/internal/batch", "headers": [],
        "query_string": b"", "state": {"api_key": None},
    }  # fmt: skip
    return Request(scope, _never_disconnects)


class BatchRunner:
    """Runs `batch.chat`, `batch.completion` and `batch.embedding` tasks with `ctx`'s engine
    and admission: a chat line as a chat turn (router/chat_turn.py) rendered as
    `POST /v1/chat/completions` renders a whole reply, a completion line through
    `CompletionHandler`, an embedding line through `EmbeddingHandler`."""

    def __init__(
        self, ctx: ServingContext, batches: BatchService, embedding_pooling: str = "auto"
    ) -> None:
        batch_ctx = copy.copy(ctx)  # shares the engine, admission and metrics
        batch_ctx.sessions = SessionManager(None)
        batch_ctx.rate_limiter = RequestRateLimiter(None, NO_RATE_LIMITS)
        self.ctx = batch_ctx
        self.batches = batches
        self._cancelled: dict[str, tuple[float, bool]] = {}
        """batch id -> (when checked, cancelled): one record read per batch per second, not
        per line (a batch record holds every line's custom_id)."""
        self.turns = ChatTurns(batch_ctx)
        self.completions = CompletionHandler(batch_ctx)
        self.embeddings = EmbeddingHandler(batch_ctx, embedding_pooling)

    @property
    def runners(self) -> dict[str, TaskRunner]:
        return {"batch.chat": self.run, "batch.completion": self.run, "batch.embedding": self.run}

    async def _is_cancelled(self, batch_id: str) -> bool:
        now = time.monotonic()
        checked = self._cancelled.get(batch_id)
        if checked is None or now - checked[0] > CANCEL_CHECK_S:
            if len(self._cancelled) > 1024:
                self._cancelled.clear()
            checked = (now, await self.batches.is_cancelled(batch_id))
            self._cancelled[batch_id] = checked
        return checked[1]

    async def _chat(self, body: ChatCompletionRequest) -> tuple[int, dict[str, Any]]:
        arrival_s = time.monotonic()
        rename = chat_rename(body)
        plan, params = self.turns.plan(body, rename)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        turn = await self.turns.open(body, plan, params, None, request_id, rename)
        [ticket] = self.ctx.admission.admit([turn.n])
        try:
            final = await final_of(turn.steps(ticket, arrival_s))
        except Exception as e:
            raise as_openai_error(e, request_id, rename) from e
        finally:
            ticket.release()
        render = ChatCompletionRender.of(
            body, request_id, self.ctx.model_name, self.ctx.token_texts
        )
        return 200, json.loads(render.response(final).model_dump_json())

    async def _completion(self, body: CompletionRequest) -> tuple[int, dict[str, Any]]:
        response = await self.completions.create(body, _internal_request())
        return response.status_code, json.loads(bytes(response.body))

    async def _embedding(self, body: EmbeddingRequest) -> tuple[int, dict[str, Any]]:
        response = await self.embeddings.create(body, _internal_request())
        return response.status_code, json.loads(bytes(response.body))

    async def run(self, delivery: Delivery) -> dict[str, Any]:
        payload = delivery.payload
        if await self._is_cancelled(payload["batch_id"]):
            message = "the batch was cancelled before this request ran"
            return {"error": {"code": "batch_cancelled", "message": message}}
        try:
            if delivery.kind == "batch.chat":
                chat = ChatCompletionRequest.model_validate(payload["body"])
                status, doc = await wait_out_overload(lambda: self._chat(chat))
            elif delivery.kind == "batch.embedding":
                embed = EmbeddingRequest.model_validate(payload["body"])
                status, doc = await wait_out_overload(lambda: self._embedding(embed))
            else:
                body = CompletionRequest.model_validate(payload["body"])
                status, doc = await wait_out_overload(lambda: self._completion(body))
        except OpenAIError as e:
            if e.status_code >= 500 or e.status_code == 429:
                raise RetryTask(f"{e.status_code} {e.type}: {e.message}") from e
            return {
                "response": {"status_code": e.status_code, "request_id": None, "body": e.to_body()}
            }
        return {"response": {"status_code": status, "request_id": doc.get("id"), "body": doc}}
