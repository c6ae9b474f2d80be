"""`duet bench serve --with-batch N`: a batch runs beside the timed load and is cancelled at
the end, its counts recorded in the result JSON; a server without a work queue is a clear
error naming the flag."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from duet.cli.main import main
from duet.engine import AsyncEngine
from duet.session_store import SqliteWorkQueue
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, closing, make_app, make_engine


@pytest.fixture(scope="module")
def engine(tiny_llama: str) -> Iterator[AsyncEngine]:
    engine = make_engine(tiny_llama)
    yield engine
    engine.shutdown()


def bench(url: str, tiny_llama: str, out: Path, *flags: str) -> int:
    return main(
        ["bench", "serve", "--url", url, "--api-key", API_KEY, "--tokenizer", tiny_llama,
         "--request-timeout-s", "60", "--num-requests", "4", "--rate", "inf",
         "--input-len-dist", "fixed:8", "--output-len-dist", "fixed:4", "--no-plot",
         "--result-json", str(out), *flags]
    )  # fmt: skip


def test_a_batch_runs_beside_the_load(engine: AsyncEngine, tiny_llama: str, tmp_path: Path) -> None:
    queue = SqliteWorkQueue(tmp_path / "queue.db")
    app = make_app(
        engine, MODEL_NAME, api_keys=[API_KEY], work_queue=queue, lifespan=closing(queue)
    )
    server = LiveServer(app).start()
    try:
        out = tmp_path / "with_batch.json"
        flags = ("--with-batch", "30", "--batch-output-len", "8")
        assert bench(server.url, tiny_llama, out, *flags) == 0
        result = json.loads(out.read_text())
        assert (result["config"]["with_batch"], result["config"]["batch_output_len"]) == (30, 8)
        batch = result["config"]["batch"]
        assert batch["id"].startswith("batch_") and batch["request_counts_at_end"]["total"] == 30
        assert result["runs"][0]["summary"]["completed"] == 4
    finally:
        server.stop()


def test_a_server_without_a_queue_is_a_clear_error(
    engine: AsyncEngine, tiny_llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = LiveServer(make_app(engine, MODEL_NAME, api_keys=[API_KEY])).start()
    try:
        assert bench(server.url, tiny_llama, tmp_path / "x.json", "--with-batch", "3") == 2
        assert "--with-batch: POST /v1/files answered 404" in capsys.readouterr().err
    finally:
        server.stop()
