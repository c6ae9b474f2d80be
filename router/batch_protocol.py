"""The OpenAI Batch API's objects (files, batches) and the validation of a batch input file.

A batch input file is JSONL: one request per line,
`{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`.
A line's `url` may be any of the endpoints, whatever the batch's `endpoint` (a duet extension:
OpenAI wants one endpoint per file), so one batch may mix chat, completions and embeddings.
A bad line never aborts the batch: it becomes an error-file entry whose message names the line
and the field. Output and error files hold one line per request, in OpenAI's format:
`{"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"} |
null, "error": {"code", "message"} | null}`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from duet.router.embeddings_protocol import EmbeddingRequest
from duet.router.errors import format_loc
from duet.router.openai_protocol import ChatCompletionRequest, CompletionRequest, JsonInt

BATCH_ENDPOINTS: dict[
    str, type[ChatCompletionRequest] | type[CompletionRequest] | type[EmbeddingRequest]
] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
}
COMPLETION_WINDOWS = ("24h",)

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
    "cancelled",
]  # fmt: skip


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


MIN_FILE_EXPIRY_S = 3600
MAX_FILE_EXPIRY_S = 30 * 24 * 3600
"""The bounds OpenAI puts on a file's `expires_after.seconds` (an hour, 30 days)."""


class ExpiresAfter(BaseModel):
    """When a file expires: `seconds` after its creation (`anchor` is always `created_at`)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    anchor: str = Field(json_schema_extra={"enum": ["created_at"]})
    seconds: JsonInt = Field(
        json_schema_extra={"minimum": MIN_FILE_EXPIRY_S, "maximum": MAX_FILE_EXPIRY_S}
    )
    """JSON Schema's `integer`, as every body's: 3600.0 is one (a strict int refused it)."""


class BatchCreateRequest(BaseModel):
    # The allowed values are checked by BatchService (400s naming the field); the schema says them.
    model_config = ConfigDict(strict=True, extra="forbid")

    input_file_id: str
    endpoint: str = Field(json_schema_extra={"enum": list(BATCH_ENDPOINTS)})
    completion_window: str = Field("24h", json_schema_extra={"enum": list(COMPLETION_WINDOWS)})
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None
    """When the batch's output and error files expire (default: the queue's retention)."""


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: dict[str, Any] | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


@dataclass(frozen=True)
class BatchLine:
    """One valid request of a batch."""

    line: int
    """1-based line number in the input file."""
    custom_id: str
    url: str
    """One of `BATCH_ENDPOINTS`."""
    body: dict[str, Any]


@dataclass(frozen=True)
class BadLine:
    """One rejected line: it goes to the error file."""

    line: int
    custom_id: str | None
    message: str


def parse_batch_file(
    data: bytes, model_names: Sequence[str]
) -> tuple[list[BatchLine], list[BadLine]]:
    """Split an input file into valid requests and rejected lines (blank lines are skipped).
    `custom_id` must be unique in the file; a repeat is rejected, the first kept."""
    good: list[BatchLine] = []
    bad: list[BadLine] = []
    seen: set[str] = set()
    text = data.decode("utf-8", errors="replace")
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        custom_id: str | None = None
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as e:
            bad.append(BadLine(number, None, f"line {number}: not valid JSON: {e.msg}"))
            continue
        if not isinstance(doc, dict):
            bad.append(BadLine(number, None, f"line {number}: must be a JSON object"))
            continue
        if isinstance(doc.get("custom_id"), str) and doc["custom_id"]:
            custom_id = doc["custom_id"]
        problem = _check_line(doc, custom_id, model_names, seen)
        if problem is not None:
            bad.append(BadLine(number, custom_id, f"line {number}: {problem}"))
            continue
        assert custom_id is not None
        seen.add(custom_id)
        good.append(BatchLine(number, custom_id, doc["url"], doc["body"]))
    return good, bad


def _check_line(
    doc: dict[str, Any], custom_id: str | None, model_names: Sequence[str], seen: set[str]
) -> str | None:
    """What is wrong with one parsed line (naming the field), or None."""
    if custom_id is None:
        return "custom_id: must be a non-empty string"
    if custom_id in seen:
        return f"custom_id: {custom_id!r} is used by an earlier line; custom_ids must be unique"
    if doc.get("method", "POST") != "POST":
        return f"method: must be 'POST'; got {doc.get('method')!r}"
    request_type = BATCH_ENDPOINTS.get(doc.get("url"))  # type: ignore[arg-type]
    if request_type is None:
        allowed = " or ".join(repr(e) for e in BATCH_ENDPOINTS)
        return f"url: must be {allowed}; got {doc.get('url')!r}"
    body = doc.get("body")
    if not isinstance(body, dict):
        return "body: must be a JSON object (the request body)"
    try:
        request = request_type.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = format_loc(("body", *first["loc"]))
        return f"body.{where}: {first['msg']}" if where else f"body: {first['msg']}"
    if request.model is not None and request.model not in model_names:
        return f"body.model: {request.model!r} is not served here; this server serves " + ", ".join(
            repr(n) for n in model_names
        )
    if getattr(request, "stream", False):
        return "body.stream: must be false in a batch (results are collected in a file)"
    if getattr(request, "session_id", None) is not None:
        return "body.session_id: not supported in a batch"
    if getattr(request, "background", False):
        return "body.background: not supported in a batch (a batch runs in the background)"
    return None
