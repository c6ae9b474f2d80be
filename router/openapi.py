"""The served OpenAPI schema (`GET /openapi.json`), made to tell the truth about errors.

FastAPI documents a 422 with its own validation-error body on every route with a body or
parameters; this server answers 400 in OpenAI's error shape instead (`router.errors`), so the
schema says that. Each route lists the other error statuses it can return, all with
`ErrorResponse` bodies, so a generated client (or schemathesis) can check every response.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from duet.router.openai_responses import ErrorResponse

_DESCRIPTIONS = {
    400: "Invalid request: the message and `param` name the field",
    401: "Missing or invalid API key",
    404: "Unknown model or session",
    408: "The request body did not arrive within the server's --body-timeout",
    409: "Another turn on the session was stored first",
    413: "The request body is larger than the server's --max-body-bytes",
    429: "Rate limited; Retry-After says when to retry",
    503: "Overloaded, engine stopped, or session store unavailable; Retry-After when known",
}


def error_responses(*status_codes: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` entries for these statuses, each with an `ErrorResponse` body."""
    return {
        code: {"model": ErrorResponse, "description": _DESCRIPTIONS[code]} for code in status_codes
    }


def install_openapi(app: FastAPI) -> None:
    """Serve the schema with FastAPI's 422 entries rewritten as this server's 400."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description,
                routes=app.routes,
            )  # fmt: skip
            _replace_422(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _replace_422(schema: dict[str, Any]) -> None:
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None and "400" not in responses:
                responses["400"] = _error_entry(400, error_ref)
            if "requestBody" in operation:  # router/http_limits.py bounds every body
                for code in (408, 413):
                    responses.setdefault(str(code), _error_entry(code, error_ref))
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


def _error_entry(code: int, error_ref: dict[str, str]) -> dict[str, Any]:
    return {
        "description": _DESCRIPTIONS[code],
        "content": {"application/json": {"schema": error_ref}},
    }
