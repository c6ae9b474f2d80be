"""REST errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every user mistake is a 4xx naming the field (`param`); FastAPI's default 422 for a body that
fails validation becomes a 400. Only an internal fault is a 500, logged with its traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from duet.engine import InvalidInputError
from duet.engine.async_engine import EngineDeadError
from duet.router.openai_protocol import LONE_SURROGATE
from duet.router.openai_responses import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error fields."""

    status_code = 500
    type = "internal_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    def to_body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_body(), status_code=self.status_code, headers=self.headers)


class BadRequestError(OpenAIError):
    status_code = 400
    type = "invalid_request_error"

    @classmethod
    def from_invalid_input(
        cls, error: InvalidInputError, rename: Mapping[str, str] | None = None
    ) -> BadRequestError:
        """The engine's error, with its field renamed to the request's name for it."""
        param = error.field if rename is None else rename.get(error.field, error.field)
        return cls(f"{param}: {error.message}", param=param)


class AuthenticationError(OpenAIError):
    status_code = 401
    type = "authentication_error"
    code = "invalid_api_key"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class ModelNotFoundError(OpenAIError):
    status_code = 404
    type = "not_found_error"
    code = "model_not_found"


class RateLimitError(OpenAIError):
    status_code = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, retry_after_s))})


class SessionNotFoundError(OpenAIError):
    """Unknown, expired or deleted session, or one that another API key owns (not told apart,
    so a key cannot probe for other keys' session ids)."""

    status_code = 404
    type = "not_found_error"
    code = "session_not_found"

    def __init__(self, session_id: str) -> None:
        shown = session_id if len(session_id) <= 64 else session_id[:64] + "..."
        super().__init__(
            f"session_id: session {shown!r} not found (unknown, expired, deleted, or created "
            "with another API key)",
            param="session_id",
        )


class SessionsDisabledError(OpenAIError):
    status_code = 404
    type = "not_found_error"
    code = "sessions_disabled"

    def __init__(self) -> None:
        super().__init__(
            "sessions are not enabled on this server (it was started without a session store)",
            param="session_id",
        )


class SessionConflictError(OpenAIError):
    """Another turn on the same session was stored first; this reply was not stored."""

    status_code = 409
    type = "conflict_error"
    code = "session_conflict"


class SessionStoreUnavailableError(OpenAIError):
    """The session store is down or slow; requests without a session still work."""

    status_code = 503
    type = "service_unavailable"
    code = "session_store_unavailable"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, retry_after_s))})


class OverloadedError(OpenAIError):
    """The admission queue is full: retry later (Retry-After says when)."""

    status_code = 503
    type = "overloaded_error"
    code = "overloaded"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, retry_after_s))})


class EngineUnavailableError(OpenAIError):
    """The engine stopped (crash or shutdown), or no worker can take the request now; a retry
    (here, once workers are back, or on another replica) may succeed. Every 503 says when to
    retry (Retry-After), so clients and proxies back off rather than hammer."""

    status_code = 503
    type = "service_unavailable"
    code = "engine_unavailable"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, retry_after_s))})


class InternalServerError(OpenAIError):
    status_code = 500
    type = "internal_error"


class RouteError(OpenAIError):
    """Starlette's own HTTP errors (unknown path, wrong method) in OpenAI's shape."""

    def __init__(
        self, status_code: int, message: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message, headers=headers)
        self.status_code = status_code
        self.type = "not_found_error" if status_code == 404 else "invalid_request_error"


def as_openai_error(
    error: BaseException, request_id: str, rename: Mapping[str, str] | None = None
) -> OpenAIError:
    """What the client sees for an error raised while running a request. Internal faults are
    logged here with the request id; their details stay in the log."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, InvalidInputError):
        return BadRequestError.from_invalid_input(error, rename)
    if isinstance(error, EngineDeadError):
        logger.warning("request %s: the engine stopped: %s", request_id, error)
        return EngineUnavailableError(f"the engine stopped ({error}); retry the request")
    logger.error("request %s failed", request_id, exc_info=error)
    return InternalServerError(f"internal error (request {request_id})")


def format_loc(loc: tuple[int | str, ...]) -> str | None:
    """`("body", "messages", 0, "content")` -> `messages[0].content`, `("query", "limit")` ->
    `limit` (as OpenAI names a parameter wherever it travels); None for the body."""
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path") else loc)
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def validation_error(exc: RequestValidationError) -> BadRequestError:
    errors = list(exc.errors())
    if not errors:
        return BadRequestError("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return BadRequestError(f"request body is not valid JSON: {detail}".rstrip(": "))
    messages = []
    for error in errors:
        if error.get("type") == LONE_SURROGATE:  # raised where the body starts: name the string
            error["loc"] = (*error.get("loc", ()), *error.get("ctx", {}).get("path", ()))
        param = format_loc(tuple(error["loc"]))
        msg = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        if param is None and error.get("type") == "missing":
            msg = "a JSON request body is required"
        elif param is None and error.get("type") in ("model_attributes_type", "dict_type"):
            msg = "the request body must be a JSON object (Content-Type: application/json)"
        messages.append(f"{param}: {msg}" if param else msg)
    return BadRequestError("; ".join(messages), param=format_loc(tuple(first.get("loc", ()))))


def allowed_methods(request: Request) -> str:
    """Every method some route serves at this request's path (a 405's `Allow`).

    NOTE: Starlette answers a 405 with the methods of the first route whose path matched, so
    a path served by two routes (`GET` and `POST /v1/batches`) named only one of them."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "\0"})
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def install_exception_handlers(app: FastAPI) -> None:
    """Map every exception a route can raise to an OpenAI-shaped error response."""

    async def on_openai_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return exc.to_response()

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_error(exc).to_response()

    async def on_invalid_input(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, InvalidInputError)
        return BadRequestError.from_invalid_input(exc).to_response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        headers = exc.headers
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": allowed_methods(request)}
        return RouteError(exc.status_code, str(exc.detail), headers).to_response()

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises the exception after this response, so the server logs the
        # traceback; say which route it was.
        logger.error("internal error on %s %s: %r", request.method, request.url.path, exc)
        return InternalServerError("internal server error").to_response()

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(InvalidInputError, on_invalid_input)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
