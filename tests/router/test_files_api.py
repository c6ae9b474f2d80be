"""The Files API beyond uploads, with the official `openai` client: `files.list` (per API key,
paginated by `after` and `limit`, ordered, filtered by `purpose`; the client's auto-pagination
walks every page), `files.delete` (the record and the bytes go; another key's file is a 404),
and `models.retrieve`."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from duet.engine import AsyncEngine
from duet.session_store import SqliteWorkQueue
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, closing, make_app

OTHER_KEY = "sk-other-key"


@pytest.fixture
def server(rest_engine: AsyncEngine, tmp_path: Path) -> Iterator[LiveServer]:
    queue = SqliteWorkQueue(tmp_path / "queue.db", lease_s=10.0)
    app = make_app(
        rest_engine, MODEL_NAME, api_keys=[API_KEY, OTHER_KEY], work_queue=queue,
        lifespan=closing(queue),
    )  # fmt: skip
    live = LiveServer(app).start()
    yield live
    live.stop()


def _client(server: LiveServer, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def _upload(client: openai.OpenAI, name: str) -> str:
    data = io.BytesIO(b'{"custom_id": "a"}\n')
    return client.files.create(file=(name, data), purpose="batch").id


def test_list_pages_orders_and_filters_by_key(server: LiveServer) -> None:
    mine, other = _client(server), _client(server, OTHER_KEY)
    ids = []
    for i in range(5):
        ids.append(_upload(mine, f"f{i}.jsonl"))
        time.sleep(0.01)
    theirs = _upload(other, "theirs.jsonl")
    newest_first = [f.id for f in mine.files.list()]
    # created_at counts seconds, ties ordered by id: one total order, reversed by `order`
    oldest_first = [f.id for f in mine.files.list(order="asc")]
    assert sorted(newest_first) == sorted(ids) and theirs not in newest_first
    assert newest_first == oldest_first[::-1]
    page = mine.files.list(limit=2, order="asc")
    assert [f.id for f in page.data] == oldest_first[:2]
    assert page.has_more is True
    walked = [f.id for f in mine.files.list(limit=2, order="asc")]  # auto-paginates: 3 pages
    assert walked == oldest_first
    last = mine.files.list(limit=2, order="asc", after=oldest_first[2])
    assert [f.id for f in last.data] == oldest_first[3:]
    assert last.has_more is False
    assert [f.id for f in other.files.list()] == [theirs]
    assert list(mine.files.list(purpose="batch_output")) == []
    assert len(list(mine.files.list(purpose="batch"))) == 5


def test_list_bad_arguments_are_400s_naming_them(server: LiveServer) -> None:
    client = _client(server)
    for kwargs, param in [
        (dict(limit=0), "limit"),
        (dict(limit=10_001), "limit"),
        (dict(order="sideways"), "order"),
        (dict(after="file-nope"), "after"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.files.list(**kwargs)  # type: ignore[arg-type]
        assert info.value.status_code == 400
        assert info.value.param == param


def test_delete_removes_the_file_and_its_bytes(server: LiveServer) -> None:
    mine, other = _client(server), _client(server, OTHER_KEY)
    keep, gone = _upload(mine, "keep.jsonl"), _upload(mine, "gone.jsonl")
    with pytest.raises(openai.NotFoundError):
        other.files.delete(gone)  # another key's file is not there for it
    deleted = mine.files.delete(gone)
    assert (deleted.id, deleted.deleted, deleted.object) == (gone, True, "file")
    assert [f.id for f in mine.files.list()] == [keep]
    with pytest.raises(openai.NotFoundError) as info:
        mine.files.retrieve(gone)
    assert info.value.status_code == 404
    with pytest.raises(openai.NotFoundError):
        mine.files.content(gone)
    with pytest.raises(openai.NotFoundError) as info:
        mine.files.delete(gone)
    assert info.value.body["param"] == "file_id"  # type: ignore[index]
    assert mine.files.content(keep).read() == b'{"custom_id": "a"}\n'


def test_models_retrieve(client: openai.OpenAI) -> None:
    model = client.models.retrieve(MODEL_NAME)
    assert (model.id, model.object, model.owned_by) == (MODEL_NAME, "model", "duet")
    assert model.model_dump()["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-nope")
    assert info.value.status_code == 404
    assert info.value.body["param"] == "model"  # type: ignore[index]
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]
