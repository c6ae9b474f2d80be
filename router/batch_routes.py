"""REST routes of the Files and Batch APIs: `POST/GET /v1/files`, `GET/DELETE /v1/files/{id}`,
`GET /v1/files/{id}/content`, `POST/GET /v1/batches`, `GET /v1/batches/{id}`,
`POST /v1/batches/{id}/cancel`, in OpenAI's shapes (router/batch_protocol.py)."""

from __future__ import annotations

from dataclasses import dataclass
from email.message import Message
from email.parser import BytesParser
from email.policy import HTTP

from fastapi import FastAPI, Query, Request, Response

from duet.router.auth import caller_api_key
from duet.router.batch_protocol import (
    Batch,
    BatchCreateRequest,
    BatchList,
    FileDeleted,
    FileList,
    FileObject,
)
from duet.router.batches import (
    MAX_FILE_EXPIRY_S,
    MAX_FILES_PAGE,
    MIN_FILE_EXPIRY_S,
    BatchService,
    check_expires_after,
)
from duet.router.errors import BadRequestError
from duet.router.openapi import error_responses

_MULTIPART_SLACK_BYTES = 64 * 1024
"""Room for the multipart framing and the other form fields around the file."""


UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object",
    "required": ["purpose", "file"],
    "additionalProperties": False,
    "dependentRequired": {
        "expires_after[anchor]": ["expires_after[seconds]"],
        "expires_after[seconds]": ["expires_after[anchor]"],
    },
    "properties": {
        "purpose": {"type": "string", "enum": ["batch"]},
        "file": {"type": "string", "format": "binary", "description": "The batch's JSONL lines"},
        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
        "expires_after[seconds]": {
            "type": "integer", "minimum": MIN_FILE_EXPIRY_S, "maximum": MAX_FILE_EXPIRY_S,
        },
    },
}}}}}  # fmt: skip
"""`POST /v1/files`'s body as the schema states it (the route reads the form itself)."""

_FORM_FIELDS = ("purpose", "file", "expires_after[anchor]", "expires_after[seconds]")


@dataclass(frozen=True)
class Upload:
    """What a `POST /v1/files` form says."""

    purpose: str
    filename: str
    data: bytes
    expires_after_s: int | None
    """`expires_after[seconds]` (anchored at the file's creation), or None: the default."""


def _expires_after(anchor: str | None, seconds: str | None) -> int | None:
    """OpenAI's `expires_after` as form fields: both or neither, anchor `created_at`, seconds
    an integer in [3600, 2592000]."""
    if anchor is None and seconds is None:
        return None
    if anchor is None or seconds is None:
        missing = "anchor" if anchor is None else "seconds"
        raise BadRequestError(
            f"expires_after.{missing}: missing (expires_after takes both anchor and seconds)",
            param=f"expires_after.{missing}",
        )
    return check_expires_after(anchor, seconds, "expires_after")


async def _read_form(raw: Request, service: BatchService) -> Upload:
    """The fields of a multipart upload, reading at most the size limit; a field it does not
    know is a 400 naming it."""
    content_type = raw.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise BadRequestError(
            "file: upload the file as multipart/form-data (fields 'purpose' and 'file')",
            param="file",
        )
    limit = service.max_file_bytes + _MULTIPART_SLACK_BYTES
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        service.check_file_size(int(declared) - _MULTIPART_SLACK_BYTES)
    body = bytearray()
    async for chunk in raw.stream():
        body += chunk
        if len(body) > limit:
            service.check_file_size(len(body) - _MULTIPART_SLACK_BYTES)
    head = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1")
    message = BytesParser(policy=HTTP).parsebytes(head + bytes(body))
    texts: dict[str, str] = {}
    file: tuple[str, bytes] | None = None
    parts: list[Message] = list(message.iter_parts()) if message.is_multipart() else []
    for part in parts:
        name = str(part.get_param("name", header="content-disposition") or "")
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        if name == "file":
            file = (part.get_filename() or "upload.jsonl", data)
        elif name in _FORM_FIELDS:
            texts[name] = data.decode("utf-8", errors="replace").strip()
        else:
            allowed = ", ".join(_FORM_FIELDS)
            raise BadRequestError(
                f"{name[:64]}: unknown form field (POST /v1/files takes {allowed})",
                param=name[:64],
            )
    if "purpose" not in texts:
        raise BadRequestError("purpose: missing form field (use 'batch')", param="purpose")
    if file is None:
        raise BadRequestError("file: missing form field (the JSONL file)", param="file")
    expires_after_s = _expires_after(
        texts.get("expires_after[anchor]"), texts.get("expires_after[seconds]")
    )
    return Upload(texts["purpose"], file[0], file[1], expires_after_s)


def install_batch_routes(app: FastAPI, service: BatchService) -> None:
    @app.post("/v1/files", responses=error_responses(400, 401, 503), openapi_extra=UPLOAD_BODY)
    async def create_file(raw: Request) -> FileObject:
        form = await _read_form(raw, service)
        return await service.create_file(
            caller_api_key(raw), form.filename, form.purpose, form.data, form.expires_after_s
        )

    @app.get("/v1/files", responses=error_responses(400, 401, 503))
    async def list_files(
        raw: Request,
        after: str | None = None,
        limit: int = Query(
            MAX_FILES_PAGE, json_schema_extra={"minimum": 1, "maximum": MAX_FILES_PAGE}
        ),
        order: str = Query("desc", json_schema_extra={"enum": ["asc", "desc"]}),
        purpose: str | None = None,
    ) -> FileList:
        return await service.list_files(caller_api_key(raw), after, limit, order, purpose)

    @app.delete("/v1/files/{file_id}", responses=error_responses(401, 404, 503))
    async def delete_file(file_id: str, raw: Request) -> FileDeleted:
        return await service.delete_file(caller_api_key(raw), file_id)

    @app.get("/v1/files/{file_id}", responses=error_responses(401, 404, 503))
    async def get_file(file_id: str, raw: Request) -> FileObject:
        return await service.get_file(caller_api_key(raw), file_id)

    @app.get(
        "/v1/files/{file_id}/content",
        responses={
            **error_responses(401, 404, 503),
            200: {
                "description": "The file's bytes",
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            },
        },
    )
    async def file_content(file_id: str, raw: Request) -> Response:
        data = await service.file_content(caller_api_key(raw), file_id)
        return Response(data, media_type="application/octet-stream")

    @app.post("/v1/batches", responses=error_responses(400, 401, 404, 503))
    async def create_batch(body: BatchCreateRequest, raw: Request) -> Batch:
        return await service.create_batch(caller_api_key(raw), body)

    @app.get("/v1/batches", responses=error_responses(400, 401, 503))
    async def list_batches(
        raw: Request,
        limit: int = Query(20, json_schema_extra={"minimum": 1, "maximum": 100}),
        after: str | None = None,
    ) -> BatchList:
        batches = await service.list_batches(caller_api_key(raw), limit, after)
        return BatchList(
            data=batches,
            first_id=batches[0].id if batches else None,
            last_id=batches[-1].id if batches else None,
        )

    @app.get("/v1/batches/{batch_id}", responses=error_responses(401, 404, 503))
    async def get_batch(batch_id: str, raw: Request) -> Batch:
        return await service.get_batch(caller_api_key(raw), batch_id)

    @app.post("/v1/batches/{batch_id}/cancel", responses=error_responses(401, 404, 503))
    async def cancel_batch(batch_id: str, raw: Request) -> Batch:
        return await service.cancel_batch(caller_api_key(raw), batch_id)
