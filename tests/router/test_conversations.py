"""The Conversations API (`/v1/conversations`, router/conversations.py), on SQLite and on a real
Redis, driven by the official openai client: create with items, retrieve, update, the items'
list (both orders, pages), one item, deleting items and the conversation, another key's 404,
bad items naming the field, concurrent writers; the Responses API's `conversation` (the
chat-completions endpoint on the whole conversation is the oracle, and the turn lands in the
conversation); and the openai-agents SDK's `OpenAIConversationsSession` keeping an agent's
memory there."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest
from agents.memory import OpenAIConversationsSession

from duet.engine import AsyncEngine
from duet.router.responses_background import KIND as RESPONSES_KIND
from duet.session_store import (
    Delivery,
    RedisSessionStore,
    RedisWorkQueue,
    SessionStore,
    SqliteSessionStore,
    SqliteWorkQueue,
    Task,
    WorkQueue,
)
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, closing, make_app
from tests.session_store.conftest import RedisServer
from tests.waiting import wait_for

OTHER_KEY = "sk-other-key"


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def server(
    request: pytest.FixtureRequest,
    rest_engine: AsyncEngine,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LiveServer]:
    """A server on each session store backend (Redis: a real redis-server)."""
    store: SessionStore
    queue: WorkQueue
    if request.param == "redis":
        redis: RedisServer = request.getfixturevalue("redis_server")
        prefix = f"conv-{uuid.uuid4().hex[:8]}"
        store = RedisSessionStore.from_url(redis.url, key_prefix=prefix)
        queue = RedisWorkQueue.from_url(redis.url, key_prefix=prefix)
    else:
        db = tmp_path_factory.mktemp("conversations") / "duet.db"
        store, queue = SqliteSessionStore(db), SqliteWorkQueue(db)
    app = make_app(rest_engine, MODEL_NAME, api_keys=[API_KEY, OTHER_KEY], session_store=store,
                   work_queue=queue, lifespan=closing(queue, store))  # fmt: skip
    live = LiveServer(app).start()
    yield live
    live.stop()


def _client(server: LiveServer, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    c = _client(server)
    yield c
    c.close()


def test_a_conversation_and_its_items(client: openai.OpenAI, server: LiveServer) -> None:
    conv = client.conversations.create(
        items=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        metadata={"topic": "greeting"},
    )
    assert conv.id.startswith("conv_") and conv.object == "conversation"
    assert conv.metadata == {"topic": "greeting"}
    assert client.conversations.retrieve(conv.id).model_dump() == conv.model_dump()
    updated = client.conversations.update(conv.id, metadata={"topic": "weather"})
    assert updated.metadata == {"topic": "weather"} and updated.id == conv.id
    added = client.conversations.items.create(conv.id, items=[
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
    ])  # fmt: skip
    assert [i.type for i in added.data] == ["function_call", "function_call_output"]
    first = list(client.conversations.items.list(conv.id, order="asc"))
    assert [i.type for i in first] == ["message", "message", "function_call",
                                       "function_call_output"]  # fmt: skip
    user, assistant = first[0], first[1]
    assert (user.role, [(c.type, c.text) for c in user.content]) == (  # type: ignore[union-attr]
        "user", [("input_text", "hi")],
    )  # fmt: skip
    assert [(c.type, c.text) for c in assistant.content] == [("output_text", "hello")]  # type: ignore[union-attr]
    ids = [i.id for i in first]
    assert len(set(ids)) == 4 and ids[2:] == [i.id for i in added.data]
    newest = client.conversations.items.list(conv.id, limit=3)  # desc by default
    assert [i.id for i in newest.data] == ids[::-1][:3] and newest.has_more
    rest = client.conversations.items.list(conv.id, limit=3, after=newest.data[-1].id)
    assert [i.id for i in rest.data] == [ids[0]] and not rest.has_more
    assert client.conversations.items.retrieve(ids[2], conversation_id=conv.id).id == ids[2]
    after_delete = client.conversations.items.delete(ids[1], conversation_id=conv.id)
    assert after_delete.id == conv.id
    assert [i.id for i in client.conversations.items.list(conv.id, order="asc")] == [
        ids[0], ids[2], ids[3],
    ]  # fmt: skip
    with pytest.raises(openai.NotFoundError) as gone:
        client.conversations.items.retrieve(ids[1], conversation_id=conv.id)
    assert gone.value.body["param"] == "item_id"
    with _client(server, OTHER_KEY) as other, pytest.raises(openai.NotFoundError):
        other.conversations.retrieve(conv.id)  # another key's: as if unknown
    with pytest.raises(openai.NotFoundError):  # a conversation is not a stored response
        client.responses.retrieve(conv.id)
    deleted = client.conversations.delete(conv.id)
    assert (deleted.id, deleted.deleted) == (conv.id, True)
    with pytest.raises(openai.NotFoundError) as unknown:
        client.conversations.retrieve(conv.id)
    assert unknown.value.body["param"] == "conversation_id"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"items": [{"role": "user", "content": "x"}, {"type": "web_search_call"}]}, "items[1]"),
        ({"items": [{"role": "user", "content": "x"}] * 21}, "items"),
        ({"items": [{"id": "m1", "role": "user", "content": "x"},
                    {"id": "m1", "role": "user", "content": "y"}]}, "items[1].id"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        # a reasoning item's summary read or not: its type is checked (schemathesis found one
        # accepted as a string beside a content list)
        ({"items": [{"type": "reasoning", "content": [], "summary": "x"}]}, "items[0].summary"),
        ({"items": [{"type": "reasoning", "content": "x"}]}, "items[0].content"),
    ],
)  # fmt: skip
def test_bad_conversations_name_the_field(
    server: LiveServer, body: dict[str, Any], param: str
) -> None:
    reply = httpx2.post(f"{server.url}/v1/conversations", json=body, timeout=30,
                        headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param or error["message"].startswith(param), error


def test_a_response_reads_and_extends_its_conversation(client: openai.OpenAI) -> None:
    history: list[Any] = [{"role": "user", "content": "Tell me a story"},
                          {"role": "assistant", "content": "Once upon a time"}]  # fmt: skip
    conv = client.conversations.create(items=history)
    response = client.responses.create(model=MODEL_NAME, input="Go on", conversation=conv.id,
                                       max_output_tokens=6, temperature=0, store=False)  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[*history, {"role": "user", "content": "Go on"}],
        max_tokens=6, temperature=0,
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.conversation is not None and response.conversation.id == conv.id
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert [i.type for i in items] == ["message"] * 4
    assert items[2].content[0].text == "Go on"  # type: ignore[union-attr]
    assert items[3].id == response.output[0].id
    assert items[3].content[0].text == response.output_text  # type: ignore[union-attr]
    # The next turn reads all four.
    again = client.responses.create(model=MODEL_NAME, input="And then?", conversation=conv.id,
                                    max_output_tokens=4, temperature=0, store=False)  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=4, temperature=0,
        messages=[*history, {"role": "user", "content": "Go on"},
                  {"role": "assistant", "content": response.output_text},
                  {"role": "user", "content": "And then?"}],
    )  # fmt: skip
    assert again.output_text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as both:
        client.responses.create(model=MODEL_NAME, input="x", conversation=conv.id,
                                previous_response_id="resp_x", max_output_tokens=2)  # fmt: skip
    assert both.value.body["param"] == "conversation"
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL_NAME, input="x", conversation="conv_nope",
                                max_output_tokens=2)  # fmt: skip
    assert missing.value.body["param"] == "conversation"


def test_an_agents_session_keeps_its_items_here(server: LiveServer) -> None:
    """openai-agents' `OpenAIConversationsSession`: its writes, reads, pop and clear."""

    async def main() -> tuple[list[Any], Any, list[Any], list[Any]]:
        api = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        session = OpenAIConversationsSession(openai_client=api)
        await session.add_items([{"role": "user", "content": f"turn {i}"} for i in range(25)])
        everything = await session.get_items()
        popped = await session.pop_item()
        latest = await session.get_items(limit=2)
        await session.clear_session()
        cleared = await session.get_items()  # a fresh conversation
        await api.close()
        return everything, popped, latest, cleared

    everything, popped, latest, cleared = asyncio.run(main())
    texts = [item["content"][0]["text"] for item in everything]
    assert texts == [f"turn {i}" for i in range(25)]  # 25 items over two requests, in order
    assert popped["content"][0]["text"] == "turn 24"
    assert [item["content"][0]["text"] for item in latest] == ["turn 22", "turn 23"]
    assert cleared == []


def test_concurrent_appends_lose_nothing(client: openai.OpenAI) -> None:
    """Eight writers adding items at once: each change is a compare-and-swap on the
    conversation's version, so every item lands, each writer's in its own order."""
    import concurrent.futures

    conv = client.conversations.create()

    def add(writer: int) -> None:
        for n in range(3):
            client.conversations.items.create(
                conv.id, items=[{"role": "user", "content": f"{writer}.{n}"}]
            )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(add, range(8)))
    texts = [i.content[0].text for i in client.conversations.items.list(conv.id, limit=100,  # type: ignore[union-attr]
                                                                         order="asc")]  # fmt: skip
    assert sorted(texts) == sorted(f"{w}.{n}" for w in range(8) for n in range(3))
    for w in range(8):
        assert [t for t in texts if t.startswith(f"{w}.")] == [f"{w}.{n}" for n in range(3)]


def test_an_input_item_resent_with_its_id_is_kept_under_a_new_one(client: openai.OpenAI) -> None:
    conv = client.conversations.create(items=[{"role": "user", "content": "hi"}])
    [first] = client.conversations.items.list(conv.id).data
    resent = {"id": first.id, "type": "message", "role": "user", "content": "hi"}
    response = client.responses.create(model=MODEL_NAME, input=[resent, resent],  # type: ignore[list-item]
                                       conversation=conv.id, max_output_tokens=2, store=False)  # fmt: skip
    assert response.status in ("completed", "incomplete")
    ids = [i.id for i in client.conversations.items.list(conv.id, order="asc")]
    assert len(ids) == 3 + len(response.output) == len(set(ids)) and ids[0] == first.id


def test_a_background_response_joins_its_conversation_once(
    client: openai.OpenAI, server: LiveServer
) -> None:
    """`conversation` with `background`: the turn joins the conversation when the response
    ends, as an interactive one's does; a delivery of the same task again (its router died
    after the response was stored) finds the turn there and adds nothing."""
    history: list[Any] = [{"role": "user", "content": "Tell me a story"},
                          {"role": "assistant", "content": "Once upon a time"}]  # fmt: skip
    conv = client.conversations.create(items=history)
    runner = server.app.state.background_worker.runners[RESPONSES_KIND].__self__
    enqueued: list[Task] = []
    enqueue = runner.queue.enqueue

    async def spy(tasks: list[Task], **kwargs: Any) -> Any:
        enqueued.extend(tasks)
        return await enqueue(tasks, **kwargs)

    runner.queue.enqueue = spy
    try:
        queued = client.responses.create(model=MODEL_NAME, input="Go on", conversation=conv.id,
                                         max_output_tokens=6, temperature=0, background=True)  # fmt: skip
    finally:
        runner.queue.enqueue = enqueue
    assert queued.status == "queued" and queued.conversation is not None
    done = wait_for(
        lambda: (r := client.responses.retrieve(queued.id)).status in ("completed", "incomplete")
        and r,
        30, "the background response to end", 0.05,
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[*history, {"role": "user", "content": "Go on"}],
        max_tokens=6, temperature=0,
    )  # fmt: skip
    assert done.output_text == chat.choices[0].message.content
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert len(items) == 4
    assert items[2].content[0].text == "Go on"  # type: ignore[union-attr]
    assert items[3].id == done.output[0].id
    [task] = enqueued
    again = Delivery(task.task_id, task.kind, task.payload, "h", "another-router", 2)
    result = asyncio.run_coroutine_threadsafe(runner.run(again), server.app.state.loop).result(30)
    assert result == {"status": done.status}
    assert [i.id for i in client.conversations.items.list(conv.id, order="asc")] == [
        i.id for i in items
    ]
    # A conversation deleted while its response waits in the queue: the response still ends.
    gone = client.conversations.create(items=history)
    worker = server.app.state.background_worker
    worker.free_slots = lambda num_running: 0  # hold the next one in the queue
    try:
        held = client.responses.create(model=MODEL_NAME, input="Go on", conversation=gone.id,
                                       max_output_tokens=6, temperature=0, background=True)  # fmt: skip
        client.conversations.delete(gone.id)
    finally:
        worker.free_slots = lambda num_running: 4
    ended = wait_for(
        lambda: (r := client.responses.retrieve(held.id)).status in ("completed", "incomplete")
        and r,
        30, "the response whose conversation is gone", 0.05,
    )  # fmt: skip
    assert ended.output_text == done.output_text
