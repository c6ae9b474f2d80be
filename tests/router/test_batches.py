"""The Batch API with the official `openai` client: upload, create, poll to `completed`, read
the output and error files; cancel; limits; two replicas sharing one Redis queue; a batch that
waits out a cluster without decode workers."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
from openai.types import Batch

from duet.engine import AsyncEngine, RequestOutput
from duet.engine.async_engine import EngineDeadError
from duet.router.batch_runner import BatchPriority
from duet.router.queue_worker import RetryBackoff
from duet.session_store import RedisWorkQueue, SqliteWorkQueue, WorkQueue
from tests.net import free_port
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, closing, make_app
from tests.session_store.conftest import RedisServer
from tests.waiting import wait_for


def serve(
    engine: AsyncEngine, queue: WorkQueue, priority: BatchPriority | None = None
) -> LiveServer:
    app = make_app(
        engine,
        MODEL_NAME,
        api_keys=[API_KEY],
        work_queue=queue,
        lifespan=closing(queue),
        batch_priority=priority,
    )
    return LiveServer(app).start()


def client_for(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def batch_server(rest_engine: AsyncEngine, tmp_path: Path) -> Iterator[LiveServer]:
    server = serve(rest_engine, SqliteWorkQueue(tmp_path / "queue.db", lease_s=10.0))
    yield server
    server.stop()


@pytest.fixture
def batch_client(batch_server: LiveServer) -> Iterator[openai.OpenAI]:
    c = client_for(batch_server)
    yield c
    c.close()


def chat_line(custom_id: str, i: int) -> dict[str, Any]:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": f"question {i}"}],
        "max_tokens": 3,
        "temperature": 0,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def completion_line(custom_id: str, i: int) -> dict[str, Any]:
    body = {"prompt": f"once upon a time {i}", "max_tokens": 3, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


BAD_LINES = [
    ("not json at all", None, "line 196: not valid JSON"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), None,
     "line 197: custom_id: must be a non-empty string"),
    (json.dumps(completion_line("c-0", 0)), "c-0", "line 198: custom_id: 'c-0' is used by an"),
    (json.dumps({**chat_line("bad-1", 1), "body": {"max_tokens": 3}}), "bad-1",
     "line 199: body.messages: Field required"),
    (json.dumps({**chat_line("bad-2", 2), "url": "/v1/moderations"}), "bad-2",
     "line 200: url: must be '/v1/chat/completions' or '/v1/completions' or '/v1/embeddings'"),
]  # fmt: skip


def input_file(num_chat: int, num_completion: int, bad: bool) -> bytes:
    lines = [json.dumps(chat_line(f"c-{i}", i)) for i in range(num_chat)]
    lines += [json.dumps(completion_line(f"p-{i}", i)) for i in range(num_completion)]
    if bad:
        lines += [raw for raw, _, _ in BAD_LINES]
    return ("\n".join(lines) + "\n").encode()


def create_batch(client: openai.OpenAI, data: bytes) -> Batch:
    file = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert (file.object, file.purpose, file.bytes) == ("file", "batch", len(data))
    return client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def wait_done(client: openai.OpenAI, batch_id: str, timeout_s: float = 120.0) -> Batch:
    def done() -> Batch | None:
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "cancelled", "failed") else None

    return wait_for(done, timeout_s, f"batch {batch_id} to finish", 0.2)


def read_jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    text = client.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines()]


def test_batch_of_200_mixed_lines_with_5_bad_ones(batch_client: openai.OpenAI) -> None:
    data = input_file(100, 95, bad=True)
    batch = create_batch(batch_client, data)
    assert batch.status == "in_progress"
    assert batch.request_counts is not None and batch.request_counts.total == 200
    done = wait_done(batch_client, batch.id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (200, 195)
    assert done.request_counts.failed == 5
    output = read_jsonl(batch_client, done.output_file_id)
    ids = [entry["custom_id"] for entry in output]
    expected = [f"c-{i}" for i in range(100)] + [f"p-{i}" for i in range(95)]
    assert ids == expected  # one result per custom_id, in input order
    for entry in output:
        assert entry["id"].startswith("batch_req_") and entry["error"] is None
        assert entry["response"]["status_code"] == 200
        body = entry["response"]["body"]
        kind = "chat.completion" if entry["custom_id"].startswith("c-") else "text_completion"
        assert body["object"] == kind and body["usage"]["completion_tokens"] == 3
        assert entry["response"]["request_id"] == body["id"]
    # A batch line answers what the interactive endpoint answers (greedy, same engine).
    direct = batch_client.chat.completions.create(**chat_line("x", 7)["body"])
    by_id = {e["custom_id"]: e for e in output}
    reply = by_id["c-7"]["response"]["body"]["choices"][0]["message"]["content"]
    assert reply == direct.choices[0].message.content
    errors = read_jsonl(batch_client, done.error_file_id)
    assert [(e["custom_id"], e["response"]) for e in errors] == [
        (custom_id, None) for _, custom_id, _ in BAD_LINES
    ]
    for entry, (_, _, message) in zip(errors, BAD_LINES, strict=True):
        assert entry["error"]["code"] == "invalid_request"
        assert entry["error"]["message"].startswith(message), entry["error"]["message"]
    assert [b.id for b in batch_client.batches.list().data] == [batch.id]


def test_a_request_rejected_by_the_endpoint_goes_to_the_error_file(
    batch_client: openai.OpenAI,
) -> None:
    too_long = {
        **chat_line("long", 0),
        "body": {**chat_line("long", 0)["body"], "max_tokens": 10**9},
    }
    data = (json.dumps(chat_line("ok", 0)) + "\n" + json.dumps(too_long) + "\n").encode()
    done = wait_done(batch_client, create_batch(batch_client, data).id)
    [error] = read_jsonl(batch_client, done.error_file_id)
    assert error["custom_id"] == "long" and error["error"] is None
    assert error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "max_tokens"
    assert [e["custom_id"] for e in read_jsonl(batch_client, done.output_file_id)] == ["ok"]


def test_cancel_skips_the_lines_not_yet_run(
    batch_client: openai.OpenAI, batch_server: LiveServer
) -> None:
    worker = batch_server.app.state.queue_worker
    worker.free_slots = lambda num_running: 0  # hold the lines in the queue
    batch = create_batch(batch_client, input_file(5, 0, bad=False))
    cancelling = batch_client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    worker.free_slots = lambda num_running: 4
    done = wait_done(batch_client, batch.id)
    assert done.status == "cancelled" and done.output_file_id is None
    errors = read_jsonl(batch_client, done.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == [f"c-{i}" for i in range(5)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


def test_bad_uploads_and_unknown_ids_are_clear_errors(
    batch_client: openai.OpenAI, batch_server: LiveServer
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        batch_client.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"  # type: ignore[index]
    service = batch_server.app.state.batches
    service.max_file_bytes, service.max_lines = 1000, 3
    with pytest.raises(openai.BadRequestError) as e:
        batch_client.files.create(file=("x.jsonl", io.BytesIO(b"x" * 1001)), purpose="batch")
    assert e.value.body["param"] == "file"  # type: ignore[index]
    assert "1001 bytes is over the limit of 1000" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        create_batch(batch_client, input_file(4, 0, bad=False)[:1000])
    assert e.value.body["param"] == "input_file_id"  # type: ignore[index]
    assert "4 requests is over the limit of 3" in e.value.message
    file = batch_client.files.create(file=("x.jsonl", io.BytesIO(b"\n")), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:
        batch_client.batches.create(
            input_file_id=file.id, endpoint="/v1/moderations", completion_window="24h"
        )
    assert e.value.body["param"] == "endpoint"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as nf:
        batch_client.batches.retrieve("batch_nope")
    assert nf.value.body["param"] == "batch_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as nf:
        batch_client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert nf.value.body["param"] == "input_file_id"  # type: ignore[index]


def test_two_replicas_share_one_redis_queue(
    rest_engine: AsyncEngine, redis_server: RedisServer
) -> None:
    """Two routers on one Redis: a batch submitted to one is finished by both, each line
    once, and either replica reports it."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    servers = [
        serve(rest_engine, RedisWorkQueue.from_url(redis_server.url, key_prefix=prefix))
        for _ in range(2)
    ]
    try:
        a, b = (client_for(s) for s in servers)
        batch = create_batch(a, input_file(30, 30, bad=False))
        done = wait_done(b, batch.id)
        assert done.status == "completed"
        ids = sorted(e["custom_id"] for e in read_jsonl(b, done.output_file_id))
        assert ids == sorted([f"c-{i}" for i in range(30)] + [f"p-{i}" for i in range(30)])
        workers = [s.app.state.queue_worker for s in servers]
        assert sum(w.num_completed for w in workers) == 60
        assert a.batches.retrieve(batch.id).output_file_id == done.output_file_id
    finally:
        for s in servers:
            s.stop()


@pytest.mark.slow
def test_a_redis_restart_mid_batch_loses_no_acknowledged_line(
    rest_engine: AsyncEngine, tmp_path: Path
) -> None:
    """Redis (AOF, fsync always) SIGKILLed and restarted while a batch runs: the batch still
    completes with every custom_id exactly once."""
    redis_server = RedisServer(tmp_path, free_port())
    redis_server.start()
    queue = RedisWorkQueue.from_url(redis_server.url, lease_s=2.0)
    # Two lines at a time (of the engine's 128 slots), so the restart falls mid-batch.
    server = serve(rest_engine, queue, BatchPriority(max_fraction=2 / 128))
    client = client_for(server)
    try:
        lines = [
            {**chat_line(f"c-{i}", i), "body": {**chat_line(f"c-{i}", i)["body"], "max_tokens": 16}}
            for i in range(60)
        ]
        data = ("\n".join(json.dumps(line) for line in lines) + "\n").encode()
        batch = create_batch(client, data)

        def some_done() -> bool:
            counts = client.batches.retrieve(batch.id).request_counts
            assert counts is not None and counts.completed < 60, "finished before the restart"
            return counts.completed >= 1

        wait_for(some_done, 60, "the first lines to finish", 0.02)
        redis_server.kill()
        redis_server.start()

        def done() -> Batch | None:
            try:
                found = client.batches.retrieve(batch.id)
            except openai.InternalServerError:  # 503 while Redis reloads
                return None
            return found if found.status == "completed" else None

        finished = wait_for(done, 120, "the batch to complete after the restart", 0.2)
        ids = sorted(e["custom_id"] for e in read_jsonl(client, finished.output_file_id))
        assert ids == sorted(f"c-{i}" for i in range(60))
        assert finished.request_counts is not None and finished.request_counts.failed == 0
    finally:
        client.close()
        server.stop()
        redis_server.stop()


def test_lines_left_when_the_window_ends_expire(
    batch_client: openai.OpenAI, batch_server: LiveServer, tmp_path: Path
) -> None:
    worker = batch_server.app.state.queue_worker
    worker.free_slots = lambda num_running: 0  # nothing runs before the window ends
    batch = create_batch(batch_client, input_file(3, 0, bad=False))

    async def end_window() -> None:
        async with SqliteWorkQueue(tmp_path / "queue.db") as queue:
            doc = await queue.get_record("batch", batch.id)
            assert doc is not None
            await queue.put_record("batch", batch.id, {**doc, "expires_at": int(time.time()) - 1})

    asyncio.run(end_window())
    expired = batch_client.batches.retrieve(batch.id)
    assert expired.status == "expired" and expired.expired_at is not None
    assert expired.request_counts is not None
    assert (expired.request_counts.completed, expired.request_counts.failed) == (0, 3)
    errors = read_jsonl(batch_client, expired.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        (f"c-{i}", "batch_expired") for i in range(3)
    ]
    worker.free_slots = lambda num_running: 4
    assert batch_client.batches.retrieve(batch.id).status == "expired"  # final


class EngineWithoutDecodeWorkers:
    """`engine` as a cluster's router sees it while its decode workers restart: every request
    is refused (503, retryable) until `up` is set."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self.up = threading.Event()
        self.num_refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[RequestOutput, None]:
        if not self.up.is_set():
            self.num_refused += 1
            raise EngineDeadError("no decode worker is available; retry later")
        async for out in self._engine.generate(*args, **kwargs):
            yield out


def test_a_batch_waits_out_a_cluster_without_decode_workers(
    rest_engine: AsyncEngine, tmp_path: Path
) -> None:
    """Ten lines on a queue that allows two deliveries, refused 40 times in all while no
    decode worker is up: none is dead-lettered; each runs once the workers are back."""
    engine = EngineWithoutDecodeWorkers(rest_engine)
    queue = SqliteWorkQueue(tmp_path / "queue.db", lease_s=10.0, max_deliveries=2)
    app = make_app(
        engine, MODEL_NAME, api_keys=[API_KEY], work_queue=queue, lifespan=closing(queue),
        queue_backoff=RetryBackoff(initial_s=0.02, max_s=0.1),
    )  # fmt: skip
    server = LiveServer(app).start()
    client = client_for(server)
    try:
        batch = create_batch(client, input_file(10, 0, bad=False))
        wait_for(lambda: engine.num_refused >= 40, 60, "40 refusals", 0.02)
        engine.up.set()
        done = wait_done(client, batch.id)
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (10, 0)
        output = read_jsonl(client, done.output_file_id)
        assert [(o["custom_id"], o["response"]["status_code"]) for o in output] == [
            (f"c-{i}", 200) for i in range(10)
        ]
        assert done.error_file_id is None
        assert server.app.state.queue_worker.num_retries >= 40
    finally:
        client.close()
        server.stop()

    async def dead() -> list[Any]:
        async with SqliteWorkQueue(tmp_path / "queue.db") as q:
            return list(await q.dead_letters())

    assert asyncio.run(dead()) == []


def test_files_expire_and_batch_outputs_take_output_expires_after(
    rest_engine: AsyncEngine, tmp_path: Path
) -> None:
    """`expires_after` on an upload and `output_expires_after` on a batch set the files'
    `expires_at` (defaults: 30 days for an upload, the queue's retention for an output), and
    past it a file is gone: not listed, 404 for it and its content. Bad values are 400s
    naming the field; an unknown form or body field too, never silently ignored."""
    skew = [0.0]
    queue = SqliteWorkQueue(tmp_path / "q.db", lease_s=10.0, clock=lambda: time.time() + skew[0])
    server = serve(rest_engine, queue)
    client = client_for(server)
    try:
        data = input_file(2, 0, bad=False)
        plain = client.files.create(file=("a.jsonl", io.BytesIO(data)), purpose="batch")
        assert plain.expires_at == plain.created_at + 30 * 24 * 3600
        hour = client.files.create(
            file=("b.jsonl", io.BytesIO(data)), purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 3600},
        )  # fmt: skip
        assert hour.expires_at == hour.created_at + 3600
        assert client.files.retrieve(hour.id).expires_at == hour.expires_at
        for expires_after, param in [
            ({"anchor": "created_at", "seconds": 3599}, "expires_after.seconds"),
            ({"anchor": "created_at", "seconds": 2592001}, "expires_after.seconds"),
            ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor"),
            ({"seconds": 3600}, "expires_after.anchor"),
        ]:
            with pytest.raises(openai.BadRequestError) as e:
                client.files.create(
                    file=("c.jsonl", io.BytesIO(data)), purpose="batch",
                    expires_after=expires_after,  # type: ignore[arg-type]
                )  # fmt: skip
            assert e.value.body["param"] == param, expires_after  # type: ignore[index]
        reply = httpx2.post(
            f"{server.url}/v1/files", headers={"authorization": f"Bearer {API_KEY}"},
            data={"purpose": "batch", "ttl": "5"}, files={"file": ("d.jsonl", data)},
        )  # fmt: skip
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "ttl"

        week = 7 * 24 * 3600
        batch = client.batches.create(
            input_file_id=plain.id, endpoint="/v1/chat/completions", completion_window="24h",
            # 604800.0: JSON Schema's integer, as the served schema says (schemathesis found
            # it refused)
            output_expires_after={"anchor": "created_at", "seconds": float(week)},
        )  # fmt: skip
        done = wait_done(client, batch.id)
        assert done.output_file_id is not None
        output = client.files.retrieve(done.output_file_id)
        assert output.expires_at == output.created_at + week
        default = wait_done(
            client,
            client.batches.create(
                input_file_id=hour.id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id,
        )
        assert default.output_file_id is not None
        kept = client.files.retrieve(default.output_file_id)
        assert kept.expires_at == kept.created_at + 30 * 24 * 3600  # the queue's retention
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(
                input_file_id=plain.id, endpoint="/v1/chat/completions", completion_window="24h",
                output_expires_after={"anchor": "created_at", "seconds": 60},
            )  # fmt: skip
        assert e.value.body["param"] == "output_expires_after.seconds"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(
                input_file_id=plain.id, endpoint="/v1/chat/completions", completion_window="24h",
                extra_body={"priority": "high"},
            )  # fmt: skip
        assert e.value.body["param"] == "priority"  # type: ignore[index]

        skew[0] = 3601.0  # an hour and a second later: the one-hour file is gone
        listed = [f.id for f in client.files.list().data]
        assert hour.id not in listed and {plain.id, output.id, kept.id} <= set(listed)
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(hour.id)
        with pytest.raises(openai.NotFoundError):
            client.files.content(hour.id)
        skew[0] = week + 1.0  # the batch's output file, asked for a week, is gone too
        with pytest.raises(openai.NotFoundError):
            client.files.content(output.id)
        assert client.files.content(kept.id).text == client.files.content(kept.id).text
        assert client.files.retrieve(plain.id).id == plain.id
    finally:
        client.close()
        server.stop()


def test_embedding_lines_answer_what_the_endpoint_answers(batch_client: openai.OpenAI) -> None:
    """`/v1/embeddings` lines (beside a chat line, in one batch): each output body is the
    endpoint's own reply to the same body; a bad one is in the error file with the endpoint's
    400."""

    def embed_line(custom_id: str, text: str) -> dict[str, Any]:
        body = {"model": MODEL_NAME, "input": text, "encoding_format": "float"}
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}

    texts = ["alpha beta", "gamma", "delta epsilon zeta"]
    lines = [embed_line(f"e-{i}", t) for i, t in enumerate(texts)]
    lines += [chat_line("c-0", 0), {**embed_line("bad", "x"), "body": {"input": [10**9]}}]
    data = ("\n".join(json.dumps(line) for line in lines) + "\n").encode()
    file = batch_client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = batch_client.batches.create(
        input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    done = wait_done(batch_client, batch.id)
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (4, 1)
    output = {e["custom_id"]: e["response"] for e in read_jsonl(batch_client, done.output_file_id)}
    assert sorted(output) == ["c-0", "e-0", "e-1", "e-2"]
    for i, text in enumerate(texts):
        direct = batch_client.embeddings.create(
            model=MODEL_NAME, input=text, encoding_format="float"
        )
        body = output[f"e-{i}"]["body"]
        assert output[f"e-{i}"]["status_code"] == 200
        assert body["data"][0]["embedding"] == direct.data[0].embedding
        assert body["usage"] == direct.usage.model_dump()
    [error] = read_jsonl(batch_client, done.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "input"
