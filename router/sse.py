"""Server-sent events as OpenAI sends them: `data: {json}\\n\\n` per event, then
`data: [DONE]\\n\\n`. A failure mid-stream ends the stream with an error event and no
`[DONE]`: `[DONE]` says the reply is whole, so a client (or proxy) that only looks for it
never takes a failed stream for a finished one. Never a hang or a silent cut."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable, Mapping

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from duet.router.errors import as_openai_error

SSE_EVENT_SCHEMA = {
    "type": "object",
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}
"""One server-sent event, as the OpenAPI schema documents a `text/event-stream` reply."""

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n\n"
"""An SSE comment (clients skip it): what a stream that waits (a background request still
queued, or between its steps) sends every `KEEPALIVE_S`, so that no proxy or client read
timeout takes the quiet for a dead connection."""
KEEPALIVE_S = 15.0


def sse_event(payload: BaseModel, exclude: set[str] | None = None) -> str:
    return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"


def sse_error(
    error: BaseException, request_id: str, rename: Mapping[str, str] | None = None
) -> str:
    """The error event that ends a stream: OpenAI's error object, `code` the HTTP status."""
    openai_error = as_openai_error(error, request_id, rename)
    body = openai_error.to_body()
    body["error"]["code"] = body["error"]["code"] or openai_error.status_code
    return f"data: {json.dumps(body)}\n\n"


class EventStreamResponse(StreamingResponse):
    """Streams SSE events; when the response ends for any reason (done, client gone, server
    shutdown) it closes the event generator, which aborts an unfinished engine request now
    rather than at garbage collection, and then calls `on_close`."""

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        on_close: Callable[[], None],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._events.aclose()
            finally:
                self._on_close()
