"""The served OpenAPI schema (`GET /openapi.json`), made to tell the truth about errors.

FastAPI documents a 422 with its own validation-error body on every route with a body or
parameters; this server answers 400 in OpenAI's error shape instead (`router.errors`), so the
schema says that. Each route lists the other error statuses it can return, all with
`ErrorResponse` bodies, so a generated client (or schemathesis) can check every response.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from duet.engine import InvalidInputError
from duet.router.engine_client import EngineClient
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


def install_openapi(app: FastAPI, engine: EngineClient | None = None) -> None:
    """Serve the schema with FastAPI's 422 entries rewritten as this server's 400, and (given
    the engine) the largest token id each token-id field accepts and the context length as
    the bound of the fields it bounds."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description,
                routes=app.routes,
            )  # fmt: skip
            _replace_422(schema)
            _exact_integer_bounds(schema)
            if engine is not None:
                _bound_token_ids(schema, token_id_maxima(engine))
                _mark(schema, "x-duet-context", {"maximum": engine.max_model_len})
                if getattr(engine, "scheduling_policy", "fcfs") != "priority":
                    _mark(schema, "x-duet-priority", {"const": 0})
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


def token_id_maxima(engine: EngineClient) -> dict[str, int]:
    """The largest id of the tokenizer (`/detokenize`) and of the model (a prompt's ids):
    the model's is the largest one-token prompt `tokenize_prompt` accepts (a model may have
    more rows than its tokenizer has tokens)."""
    lo, hi = 0, 1 << 31  # lo: accepted; hi: refused
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            engine.tokenize_prompt([mid])
            lo = mid
        except InvalidInputError:
            hi = mid
    return {"tokenizer": engine.tokenizer.vocab_size - 1, "model": lo}


def _schemas(node: Any) -> Iterator[dict[str, Any]]:
    """Every object in a schema document, each before the ones inside it."""
    if isinstance(node, dict):
        yield node
        for value in list(node.values()):
            yield from _schemas(value)
    elif isinstance(node, list):
        for value in node:
            yield from _schemas(value)


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _exact_integer_bounds(schema: dict[str, Any]) -> None:
    """An integer schema's bounds as JSON integers. FastAPI's OpenAPI models hold every bound
    as a float (`ge=1` is served as `1.0`); a client that generates values from the schema
    then works in floats, and near 2^63 (a seed's range) floats are 2048 apart: it sent
    -2^63 - 192 as within `minimum: -2^63`. (Bounds that are floats by then stay as they are:
    only integral ones, which are exact, are turned back.)"""
    for node in _schemas(schema):
        if node.get("type") == "integer":
            for key in _BOUNDS:
                value = node.get(key)
                if isinstance(value, float) and value.is_integer():
                    node[key] = int(value)


def _bound_token_ids(schema: dict[str, Any], maxima: dict[str, int]) -> None:
    """Set `maximum` on every schema the request bodies mark `x-duet-token-id`."""
    for node in _schemas(schema):
        if (kind := node.get("x-duet-token-id")) in maxima:
            node["maximum"] = maxima[kind]


def _mark(schema: dict[str, Any], marker: str, extra: dict[str, Any]) -> None:
    """Add `extra` to every schema carrying `marker` (e.g. priority, which only a server that
    schedules by priority accepts other than 0: serving_context.check_priority)."""
    for node in _schemas(schema):
        if node.get(marker):
            node.update(extra)
