"""REST routes of the Files and Batch APIs: `POST/GET /v1/files`, `GET/DELETE /v1/files/{id}`,
`GET /v1/files/{id}/content`, `POST/GET /v1/batches`, `GET /v1/batches/{id}`,
`POST /v1/batches/{id}/cancel`, in OpenAI's shapes (router/batch_protocol.py)."""

from __future__ import annotations

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
from duet.router.batches import MAX_FILES_PAGE, BatchService
from duet.router.errors import BadRequestError
from duet.router.openapi import error_responses

_MULTIPART_SLACK_BYTES = 64 * 1024
"""Room for the multipart framing and the other form fields around the file."""


UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object",
    "required": ["purpose", "file"],
    "properties": {
        "purpose": {"type": "string", "enum": ["batch"]},
        "file": {"type": "string", "format": "binary", "description": "The batch's JSONL lines"},
    },
}}}}}  # fmt: skip
"""`POST /v1/files`'s body as the schema states it (the route reads the form itself)."""


async def _read_form(raw: Request, service: BatchService) -> tuple[str, str, bytes]:
    """(purpose, filename, file bytes) of a multipart upload, reading at most the size limit."""
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
    purpose: str | None = None
    file: tuple[str, bytes] | None = None
    parts: list[Message] = list(message.iter_parts()) if message.is_multipart() else []
    for part in parts:
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        if name == "purpose":
            purpose = data.decode("utf-8", errors="replace").strip()
        elif name == "file":
            file = (part.get_filename() or "upload.jsonl", data)
    if purpose is None:
        raise BadRequestError("purpose: missing form field (use 'batch')", param="purpose")
    if file is None:
        raise BadRequestError("file: missing form field (the JSONL file)", param="file")
    return purpose, file[0], file[1]


def install_batch_routes(app: FastAPI, service: BatchService) -> None:
    @app.post("/v1/files", responses=error_responses(400, 401, 503), openapi_extra=UPLOAD_BODY)
    async def create_file(raw: Request) -> FileObject:
        purpose, filename, data = await _read_form(raw, service)
        return await service.create_file(caller_api_key(raw), filename, purpose, data)

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
