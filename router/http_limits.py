"""What one HTTP client may cost the REST server: the size of a request body, how long its
headers and body may take to arrive, and how many connections are open at once.

- Body size: `BodyLimitMiddleware` answers 413 in OpenAI's error shape for a body larger than
  `max_body_bytes`: at once from `Content-Length`, or as soon as a chunked body passes it; the
  rest is never read, parsed or tokenized. The default is sized from the model's context
  (`default_max_body_bytes`). `POST /v1/files` bounds its own uploads (router/batch_routes.py).
- Slow clients: headers must arrive within `header_timeout_s` of the connection (or of the
  previous response on a kept-alive one), else the connection is closed; a body must arrive
  within `body_timeout_s` of its request's headers, else 408. Connections past
  `max_connections` get a 503 (Retry-After) and are closed before anything is read.

uvicorn has no header or body read timeout and no connection cap of its own (its
`limit_concurrency` still accepts the connection and reads the request), hence
`bounded_h11_protocol`, its HTTP/1.1 protocol with the header deadline and the cap.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from duet.router.errors import RouteError

BODY_BASE_BYTES = 1 << 20
"""Room in every request body for what is not the prompt: tools, schemas, options."""
BODY_BYTES_PER_TOKEN = 64
"""Bytes per token of context: a prompt that fills the context in any script, JSON-escaped
(`\\uXXXX` is 6 bytes a character), with room to spare; a realistic one takes about 4."""
OWN_LIMIT_PATHS = frozenset({"/v1/files"})
"""Routes that bound their own bodies (file uploads, up to 32 MiB)."""


def default_max_body_bytes(max_model_len: int) -> int:
    """The body cap for a model whose context is `max_model_len` tokens."""
    return BODY_BASE_BYTES + BODY_BYTES_PER_TOKEN * max_model_len


@dataclass(frozen=True)
class HttpLimits:
    """The REST server's bounds on one client (`duet serve` flags, docs/serving.md)."""

    max_body_bytes: int | None = None
    """Largest request body (413 beyond); None: `default_max_body_bytes` of the model."""
    header_timeout_s: float = 10.0
    """A request's headers must arrive within this long, else the connection is closed."""
    body_timeout_s: float = 60.0
    """A request's body must arrive within this long of its headers, else 408."""
    max_connections: int = 1024
    """Open connections at most; one more gets a 503 and is closed."""

    def __post_init__(self) -> None:
        if self.max_body_bytes is not None and self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes: must be >= 1024; got {self.max_body_bytes}")
        for flag, value in (
            ("--header-timeout", self.header_timeout_s),
            ("--body-timeout", self.body_timeout_s),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag}: must be > 0 seconds; got {value}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections: must be >= 1; got {self.max_connections}")

    def body_bytes(self, max_model_len: int) -> int:
        return self.max_body_bytes or default_max_body_bytes(max_model_len)


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a body passes the cap: an `HTTPException`, so FastAPI's body
    parsing lets it through to the OpenAI-shaped error handler."""

    def __init__(self, max_body_bytes: int) -> None:
        super().__init__(
            413,
            f"request body: larger than the limit of {max_body_bytes} bytes "
            "(the server's --max-body-bytes)",
        )


class BodyTimeout(HTTPException):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"request body: not received within {timeout_s:g}s")


class BodyLimitMiddleware:
    """Bounds each HTTP request body by size and by time (see the module's docstring)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OWN_LIMIT_PATHS:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            error = BodyTooLarge(self.max_body_bytes)
            response = RouteError(413, str(error.detail)).to_response()
            response.headers["Connection"] = "close"  # the body is never read
            await response(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        num_bytes = 0
        body_done = False

        async def bounded_receive() -> Message:
            nonlocal num_bytes, body_done
            if body_done:  # later calls wait for a disconnect: no deadline of ours
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(self.body_timeout_s) from None
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        await self.app(scope, bounded_receive, send)


def _refusal(status: str, message: str, headers: dict[str, str]) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": "service_unavailable", "param": None,
                   "code": "too_many_connections"}}
    ).encode()  # fmt: skip
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{head}"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


def bounded_h11_protocol(limits: HttpLimits) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with `limits`' header deadline and connection cap (pass it
    as `uvicorn.Config(http=...)`)."""

    class BoundedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                message = f"too many connections (the server's limit is {limits.max_connections})"
                transport.write(_refusal("503 Service Unavailable", message, {"retry-after": "1"}))
                transport.close()
                return
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            finished = self.cycle
            super().on_response_complete()  # may start a pipelined request's cycle
            if self.cycle is finished:
                self._arm_header_deadline()  # the next request on a kept-alive connection

        def _arm_header_deadline(self) -> None:
            if not self.transport.is_closing():
                self.loop.call_later(limits.header_timeout_s, self._headers_late, self.cycle)

        def _headers_late(self, cycle: Any) -> None:
            # Headers complete start a new cycle: the same one means none arrived in time.
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()

    return BoundedH11Protocol
