"""The OpenAI Batch API on the durable work queue: files and batches shared by every replica.

A batch is created in one atomic `WorkQueue.enqueue`: its record, one task per valid line
(task id `<batch_id>:<line>`) and, for every rejected line, its error result. Any replica's
queue worker runs the tasks (router/queue_worker.py); the batch's progress is the count of
stored results, so nothing but the results needs updating as lines finish. Reading a batch
whose every line has a result finalizes it: the output and error files are written (their ids
and contents derive from the batch, so two replicas finalizing at once write the same thing)
and the status becomes `completed` (or `cancelled`).

Files and batches belong to the API key that created them (stored as its hash); another key
gets 404, as for an unknown id.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from duet.router.batch_protocol import (
    BATCH_ENDPOINTS,
    COMPLETION_WINDOWS,
    MAX_FILE_EXPIRY_S,
    MIN_FILE_EXPIRY_S,
    Batch,
    BatchCreateRequest,
    BatchRequestCounts,
    FileDeleted,
    FileList,
    FileObject,
    parse_batch_file,
)
from duet.router.errors import BadRequestError, OpenAIError, SessionStoreUnavailableError
from duet.session_store import SessionStoreUnavailable, Task, WorkQueue, hash_api_key

logger = logging.getLogger(__name__)

MAX_BATCH_FILE_BYTES = 32 * 1024 * 1024
"""Largest accepted batch input file."""
MAX_BATCH_LINES = 10_000
"""Most requests in one batch."""
MAX_FILES_PAGE = 10_000
"""Most files in one page of `GET /v1/files` (OpenAI's limit, and its default)."""
DEFAULT_FILE_EXPIRY_S = MAX_FILE_EXPIRY_S
"""An uploaded file's lifetime without `expires_after` (OpenAI: batch files expire after 30
days)."""
BATCH_KINDS = {
    "/v1/chat/completions": "batch.chat",
    "/v1/completions": "batch.completion",
    "/v1/embeddings": "batch.embedding",
}
_FINAL = ("completed", "cancelled", "failed", "expired")


class NotFoundError(OpenAIError):
    status_code = 404
    type = "not_found_error"
    code = "not_found"


@contextmanager
def queue_errors() -> Iterator[None]:
    try:
        yield
    except SessionStoreUnavailable as e:
        logger.warning("work queue unavailable: %s", e)
        raise SessionStoreUnavailableError(
            "the work queue is unavailable; retry shortly (interactive requests are not affected)"
        ) from None


def _owner(api_key: str | None) -> str:
    return hash_api_key(api_key) or ""


def check_expires_after(anchor: str, seconds: object, param: str) -> int:
    """OpenAI's `expires_after` (an upload's, or a batch's `output_expires_after`: `param`):
    anchor `created_at` and the seconds (a form field's text or JSON's int) in [3600,
    2592000]; else a 400 naming `<param>.anchor` or `<param>.seconds`."""
    if anchor != "created_at":
        raise BadRequestError(
            f"{param}.anchor: must be 'created_at'; got {anchor[:64]!r}", param=f"{param}.anchor"
        )
    return _check_expiry_seconds(seconds, f"{param}.seconds")


def _check_expiry_seconds(value: object, param: str) -> int:
    text = str(value).strip()
    try:
        if isinstance(value, bool):
            raise ValueError
        seconds = int(text)
    except ValueError:
        raise BadRequestError(
            f"{param}: must be an integer; got {text[:64]!r}", param=param
        ) from None
    if not MIN_FILE_EXPIRY_S <= seconds <= MAX_FILE_EXPIRY_S:
        raise BadRequestError(
            f"{param}: must be in [{MIN_FILE_EXPIRY_S}, {MAX_FILE_EXPIRY_S}] seconds; "
            f"got {seconds}",
            param=param,
        )
    return seconds


def _request_id(batch_id: str, line: int) -> str:
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{line}".encode()).hexdigest()[:32]


class BatchService:
    """Files and batches in `queue`'s records and blobs. Calls run on one event loop."""

    def __init__(
        self,
        queue: WorkQueue,
        model_names: Sequence[str],
        *,
        max_file_bytes: int = MAX_BATCH_FILE_BYTES,
        max_lines: int = MAX_BATCH_LINES,
    ) -> None:
        self.queue = queue
        self.model_names = tuple(model_names)
        self.max_file_bytes = max_file_bytes
        self.max_lines = max_lines

    # --- files ---

    async def create_file(
        self,
        api_key: str | None,
        filename: str,
        purpose: str,
        data: bytes,
        expires_after_s: int | None = None,
    ) -> FileObject:
        """Store an upload; it expires `expires_after_s` after now (default 30 days, as
        OpenAI's batch files do), its bytes and record together."""
        if purpose != "batch":
            raise BadRequestError(
                f"purpose: only 'batch' is supported; got {purpose!r}", param="purpose"
            )
        self.check_file_size(len(data))
        created_at = int(time.time())
        file = FileObject(
            id=f"file-{uuid.uuid4().hex}",
            bytes=len(data),
            created_at=created_at,
            filename=filename,
            purpose=purpose,
            expires_at=created_at + (expires_after_s or DEFAULT_FILE_EXPIRY_S),
        )
        await self._put_file(file, data, _owner(api_key))
        return file

    async def _put_file(self, file: FileObject, data: bytes, owner: str) -> None:
        """The file's bytes and record, both expiring at its `expires_at`."""
        assert file.expires_at is not None
        with queue_errors():
            await self.queue.put_blob(file.id, data, expires_at=file.expires_at)
            await self.queue.put_record(
                "file", file.id, {**file.model_dump(), "owner": owner}, expires_at=file.expires_at
            )

    def check_file_size(self, num_bytes: int) -> None:
        if num_bytes > self.max_file_bytes:
            raise BadRequestError(
                f"file: {num_bytes} bytes is over the limit of {self.max_file_bytes} bytes",
                param="file",
            )

    async def get_file(self, api_key: str | None, file_id: str) -> FileObject:
        with queue_errors():
            doc = await self.queue.get_record("file", file_id)
        if doc is None or doc.get("owner") != _owner(api_key):
            raise NotFoundError(f"file_id: file {file_id[:64]!r} not found", param="file_id")
        return FileObject.model_validate(doc)

    async def file_content(self, api_key: str | None, file_id: str) -> bytes:
        await self.get_file(api_key, file_id)
        with queue_errors():
            data = await self.queue.get_blob(file_id)
        if data is None:
            raise NotFoundError(f"file_id: content of {file_id!r} not found", param="file_id")
        return data

    async def list_files(
        self,
        api_key: str | None,
        after: str | None = None,
        limit: int = MAX_FILES_PAGE,
        order: str = "desc",
        purpose: str | None = None,
    ) -> FileList:
        """One page of the key's files (OpenAI's `GET /v1/files`): by creation time (`order`
        desc, the default, newest first), ties by id, the page after the file `after`, at most
        `limit`, only those of `purpose` when given."""
        if not 1 <= limit <= MAX_FILES_PAGE:
            raise BadRequestError(
                f"limit: must be in [1, {MAX_FILES_PAGE}]; got {limit}", param="limit"
            )
        if order not in ("asc", "desc"):
            raise BadRequestError(f"order: must be 'asc' or 'desc'; got {order!r}", param="order")
        with queue_errors():
            docs = await self.queue.list_records("file")
        owner = _owner(api_key)
        mine = sorted(
            (d for d in docs if d.get("owner") == owner),
            key=lambda d: (d["created_at"], d["id"]),
            reverse=order == "desc",
        )
        if purpose is not None:
            mine = [d for d in mine if d["purpose"] == purpose]
        if after is not None:
            ids = [d["id"] for d in mine]
            if after not in ids:
                raise BadRequestError(
                    f"after: no file {after[:64]!r} in this list (an id from a previous page)",
                    param="after",
                )
            mine = mine[ids.index(after) + 1 :]
        page = [FileObject.model_validate(d) for d in mine[:limit]]
        return FileList(
            data=page,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=len(mine) > limit,
        )

    async def delete_file(self, api_key: str | None, file_id: str) -> FileDeleted:
        """Remove one of the key's files and its bytes (a batch that read it keeps running:
        its requests were queued when it was created)."""
        await self.get_file(api_key, file_id)
        with queue_errors():
            removed = await self.queue.delete_record("file", file_id)
            await self.queue.delete_blob(file_id)
        if not removed:  # deleted meanwhile by another request
            raise NotFoundError(f"file_id: file {file_id[:64]!r} not found", param="file_id")
        return FileDeleted(id=file_id)

    # --- batches ---

    async def create_batch(self, api_key: str | None, body: BatchCreateRequest) -> Batch:
        if body.endpoint not in BATCH_ENDPOINTS:
            allowed = ", ".join(BATCH_ENDPOINTS)
            raise BadRequestError(
                f"endpoint: must be one of {allowed}; got {body.endpoint!r}", param="endpoint"
            )
        if body.completion_window not in COMPLETION_WINDOWS:
            raise BadRequestError(
                f"completion_window: must be '24h'; got {body.completion_window!r}",
                param="completion_window",
            )
        try:
            data = await self.file_content(api_key, body.input_file_id)
        except NotFoundError:
            raise NotFoundError(
                f"input_file_id: file {body.input_file_id[:64]!r} not found",
                param="input_file_id",
            ) from None
        good, bad = parse_batch_file(data, self.model_names)
        num_lines = len(good) + len(bad)
        if num_lines == 0:
            raise BadRequestError("input_file_id: the file has no requests", param="input_file_id")
        if num_lines > self.max_lines:
            raise BadRequestError(
                f"input_file_id: {num_lines} requests is over the limit of {self.max_lines} "
                "per batch",
                param="input_file_id",
            )
        output_expiry_s = None
        if body.output_expires_after is not None:
            expiry = body.output_expires_after
            output_expiry_s = check_expires_after(
                expiry.anchor, expiry.seconds, "output_expires_after"
            )
        now = int(time.time())
        batch_id = f"batch_{uuid.uuid4().hex}"
        batch = Batch(
            id=batch_id,
            endpoint=body.endpoint,
            input_file_id=body.input_file_id,
            completion_window=body.completion_window,
            status="in_progress",
            created_at=now,
            in_progress_at=now,
            expires_at=now + 24 * 3600,
            request_counts=BatchRequestCounts(total=num_lines, completed=0, failed=len(bad)),
            metadata=body.metadata,
        )
        lines = sorted([(g.line, g.custom_id) for g in good] + [(b.line, b.custom_id) for b in bad])
        record = {**batch.model_dump(), "owner": _owner(api_key), "lines": lines,
                  "output_expiry_s": output_expiry_s}  # fmt: skip
        tasks = [
            Task(
                f"{batch_id}:{g.line}",
                BATCH_KINDS[g.url],
                {"batch_id": batch_id, "line": g.line, "body": g.body},
            )
            for g in good
        ]
        errors = {
            f"{batch_id}:{b.line}": {"error": {"code": "invalid_request", "message": b.message}}
            for b in bad
        }
        with queue_errors():
            await self.queue.enqueue(tasks, errors, ("batch", batch_id, record))
        return batch

    async def _record(self, api_key: str | None, batch_id: str) -> dict[str, Any]:
        with queue_errors():
            doc = await self.queue.get_record("batch", batch_id)
        if doc is None or doc.get("owner") != _owner(api_key):
            raise NotFoundError(f"batch_id: batch {batch_id[:64]!r} not found", param="batch_id")
        return doc

    async def get_batch(self, api_key: str | None, batch_id: str) -> Batch:
        return await self._refresh(await self._record(api_key, batch_id))

    async def list_batches(
        self, api_key: str | None, limit: int = 20, after: str | None = None
    ) -> list[Batch]:
        if not 1 <= limit <= 100:
            raise BadRequestError(f"limit: must be in [1, 100]; got {limit}", param="limit")
        with queue_errors():
            docs = await self.queue.list_records("batch")
        mine = sorted(
            (d for d in docs if d.get("owner") == _owner(api_key)),
            key=lambda d: (-d["created_at"], d["id"]),
        )
        if after is not None:
            ids = [d["id"] for d in mine]
            mine = mine[ids.index(after) + 1 :] if after in ids else []
        return [await self._refresh(d) for d in mine[:limit]]

    async def cancel_batch(self, api_key: str | None, batch_id: str) -> Batch:
        doc = await self._record(api_key, batch_id)
        if doc["status"] in ("in_progress", "validating"):
            doc = {**doc, "status": "cancelling", "cancelling_at": int(time.time())}
            with queue_errors():
                await self.queue.put_record("batch", batch_id, doc)
        return await self._refresh(doc)

    async def is_cancelled(self, batch_id: str) -> bool:
        """Whether the batch's remaining lines should be skipped (cancelled, expired or gone)."""
        doc = await self.queue.get_record("batch", batch_id)
        return (
            doc is None
            or doc["status"] in ("cancelling", "cancelled", "expired")
            or (time.time() >= doc["expires_at"])
        )

    async def _refresh(self, doc: dict[str, Any]) -> Batch:
        """The batch with its current counts; finalized if every line has a result."""
        if doc["status"] in _FINAL:
            return Batch.model_validate(doc)
        lines: list[tuple[int, str | None]] = [tuple(x) for x in doc["lines"]]
        with queue_errors():
            results = await self.queue.results([f"{doc['id']}:{line}" for line, _ in lines])
        ok = sum(1 for r in results if r is not None and _succeeded(r))
        done = sum(1 for r in results if r is not None)
        counts = BatchRequestCounts(total=len(lines), completed=ok, failed=done - ok)
        doc = {**doc, "request_counts": counts.model_dump()}
        if done < len(lines) and time.time() >= doc["expires_at"]:
            return await self._expire(doc, lines)
        if done < len(lines):
            return Batch.model_validate(doc)
        return await self._finalize(doc, lines, results)

    async def _expire(self, doc: dict[str, Any], lines: list[tuple[int, str | None]]) -> Batch:
        """The completion window ended: every line without a result gets the expiry error (a
        line finishing meanwhile keeps its own result: results are stored once)."""
        message = "the batch's completion window ended before this request ran"
        expired = {"error": {"code": "batch_expired", "message": message}}
        task_ids = [f"{doc['id']}:{line}" for line, _ in lines]
        with queue_errors():
            await self.queue.enqueue([], {t: expired for t in task_ids})
            results = await self.queue.results(task_ids)
        return await self._finalize({**doc, "expiring": True}, lines, results)

    async def _finalize(
        self,
        doc: dict[str, Any],
        lines: list[tuple[int, str | None]],
        results: list[dict[str, Any] | None],
    ) -> Batch:
        batch_id = doc["id"]
        output: list[str] = []
        errors: list[str] = []
        for (line, custom_id), result in zip(lines, results, strict=True):
            assert result is not None
            entry = {
                "id": _request_id(batch_id, line),
                "custom_id": custom_id,
                "response": result.get("response"),
                "error": result.get("error"),
            }
            (output if _succeeded(result) else errors).append(json.dumps(entry))
        now = int(time.time())
        final = {**doc, "finalizing_at": doc.get("finalizing_at") or now}
        expiring = final.pop("expiring", False)
        ok = sum(1 for r in results if r is not None and _succeeded(r))
        final["request_counts"] = BatchRequestCounts(
            total=len(lines), completed=ok, failed=len(lines) - ok
        ).model_dump()
        if doc["status"] == "cancelling":
            final.update(status="cancelled", cancelled_at=now)
        elif expiring:
            final.update(status="expired", expired_at=now)
        else:
            final.update(status="completed", completed_at=now)
        # Without output_expires_after the files live as long as the queue keeps anything.
        lifetime = doc.get("output_expiry_s") or int(self.queue.retention_s)
        for suffix, entries in (("output", output), ("errors", errors)):
            if not entries:
                continue
            file_id = f"file-{batch_id.removeprefix('batch_')}-{suffix}"
            data = ("\n".join(entries) + "\n").encode()
            file = FileObject(
                id=file_id, bytes=len(data), created_at=now, filename=f"{batch_id}_{suffix}.jsonl",
                purpose="batch_output", expires_at=now + lifetime,
            )  # fmt: skip
            await self._put_file(file, data, doc["owner"])
            final["output_file_id" if suffix == "output" else "error_file_id"] = file_id
        with queue_errors():
            await self.queue.put_record("batch", batch_id, final)
        return Batch.model_validate(final)


def _succeeded(result: dict[str, Any]) -> bool:
    response = result.get("response")
    return isinstance(response, dict) and response.get("status_code") == 200
