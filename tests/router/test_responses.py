"""The Responses API driven by the official openai client: plain, streamed (the exact typed event
sequence), a function-tool round trip through `previous_response_id`, `text.format`
json_schema, stored responses (get, delete), background responses and their cancellation. The
chat-completions endpoint on the same greedy request is the oracle for text and prompt length."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx2
import jsonschema
import openai
import pytest

from duet.engine import AsyncEngine
from duet.router import sse
from duet.session_store import SqliteSessionStore, SqliteWorkQueue
from tests.router.rest_server import (
    API_KEY,
    MODEL_NAME,
    LiveServer,
    closing,
    make_app,
    wait_until_idle,
)
from tests.waiting import wait_for

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL: Any = {"type": "function", "name": "get_weather", "description": "the weather",
             "parameters": WEATHER, "strict": True}  # fmt: skip
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"enum": ["a", "b"]}},
    "required": ["x", "y"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(
    rest_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    db = tmp_path_factory.mktemp("responses") / "duet.db"
    queue, store = SqliteWorkQueue(db), SqliteSessionStore(db)
    app = make_app(
        rest_engine, MODEL_NAME, api_keys=[API_KEY], work_queue=queue, session_store=store,
        lifespan=closing(queue, store),
    )  # fmt: skip
    live = LiveServer(app).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    yield c
    c.close()


def _chat(client: openai.OpenAI, messages: list[Any], max_tokens: int, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0, **extra
    )


def test_plain_response_matches_the_chat_completion_and_is_stored(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL_NAME, input="Tell me a story", instructions="Be brief.",
        max_output_tokens=6, temperature=0, metadata={"run": "7"},
    )  # fmt: skip
    chat = _chat(
        client,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me a story"},
        ],
        6,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == MODEL_NAME and response.metadata == {"run": "7"}
    assert response.output_text == chat.choices[0].message.content
    finished = {"length": "incomplete", "stop": "completed"}[chat.choices[0].finish_reason]
    assert response.status == finished
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == finished
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert (response.instructions, response.max_output_tokens, response.store) == (
        "Be brief.", 6, True,
    )  # fmt: skip
    fetched = client.responses.retrieve(response.id)
    assert fetched.model_dump() == response.model_dump()
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(response.id)
    assert gone.value.body["param"] == "response_id"


def test_streamed_events_are_the_typed_sequence(client: openai.OpenAI) -> None:
    plain = client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=8,
                                    temperature=0, store=False)  # fmt: skip
    events = list(client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=8,
                                          temperature=0, store=False, stream=True))  # fmt: skip
    types = [e.type for e in events]
    terminal = {"completed": "response.completed", "incomplete": "response.incomplete"}
    num_deltas = types.count("response.output_text.delta")
    assert num_deltas >= 1
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * num_deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        terminal[plain.status or ""],
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, last = events[0], events[-1]
    assert created.response.status == "in_progress" and created.response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text
    done = events[-4]
    assert done.type == "response.output_text.done" and done.text == text
    final = last.response
    assert final.output_text == text and final.id == created.response.id
    assert final.output[0].id == events[2].item.id
    assert final.usage == plain.usage
    with pytest.raises(openai.NotFoundError):  # store=False: nothing kept
        client.responses.retrieve(final.id)


def test_function_tool_round_trip_through_previous_response_id(client: openai.OpenAI) -> None:
    """A required tool call (the grammar's), its output sent back by `previous_response_id`:
    the second turn's prompt is the whole conversation, as chat completions renders it."""
    first = client.responses.create(
        model=MODEL_NAME, input="Weather in Paris?", tools=[TOOL], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=150, temperature=0,
    )  # fmt: skip
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert first.status == "completed" and first.tool_choice == "required"
    second = client.responses.create(
        model=MODEL_NAME, previous_response_id=first.id, tools=[TOOL], max_output_tokens=5,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        temperature=0,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]  # fmt: skip
    chat_tools: Any = [{"type": "function", "function": {"name": "get_weather",
                        "description": "the weather", "parameters": WEATHER}}]  # fmt: skip
    chat = _chat(client, messages, 5, tools=chat_tools)
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == (chat.choices[0].message.content or "")
    # The same conversation sent whole, as items (what the Agents SDK does), renders alike.
    whole = client.responses.create(
        model=MODEL_NAME, tools=[TOOL], max_output_tokens=5, temperature=0, store=False,
        input=[{"role": "user", "content": "Weather in Paris?"}, call.model_dump(),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert whole.usage is not None and whole.usage.input_tokens == second.usage.input_tokens
    assert whole.output_text == second.output_text


def test_streamed_function_call_events(client: openai.OpenAI) -> None:
    events = list(client.responses.create(
        model=MODEL_NAME, input="Weather?", tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=150,
        temperature=0, stream=True, store=False,
    ))  # fmt: skip
    types = [e.type for e in events]
    num_deltas = types.count("response.function_call_arguments.delta")
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * num_deltas,
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    arguments = "".join(e.delta for e in events if e.type.endswith("arguments.delta"))
    assert events[-3].arguments == arguments
    jsonschema.validate(json.loads(arguments), WEATHER)
    [item] = events[-1].response.output
    assert item.type == "function_call" and item.arguments == arguments


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL_NAME, input="A point", max_output_tokens=30, store=False, temperature=0,
        text={"format": {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(response.output_text), POINT)
    assert response.status == "completed"  # the grammar ended the reply
    assert response.text is not None and response.text.format.type == "json_schema"
    # The SDK's own stream accumulator assembles the same response from the events.
    with client.responses.stream(
        model=MODEL_NAME, input="A point", max_output_tokens=30, store=False, temperature=0,
        text={"format": {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}},
    ) as stream:  # fmt: skip
        assembled = stream.get_final_response()
    assert assembled.output_text == response.output_text and assembled.status == "completed"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                                            "schema": {"type": "nope"}}}}, "text.format.schema"),
        ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice"),
        ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": "x", "max_output_tokens": 1 << 20}, "max_output_tokens"),
        ({"input": "x", "include": ["message.output_text.logprobs", "x.y"]}, "include[1]"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_responses_field(
    server: LiveServer, body: dict[str, Any], param: str
) -> None:
    reply = httpx2.post(f"{server.url}/v1/responses", json=body, timeout=30,
                        headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert error["param"] == param or error["message"].startswith(param), error


def test_ignored_fields_are_named_in_a_header(server: LiveServer) -> None:
    body = {"input": "x", "max_output_tokens": 2, "store": False,
            "include": ["reasoning.encrypted_content", "web_search_call.results"],
            "truncation": "auto", "service_tier": "flex", "user": "u1", "max_tool_calls": 2}  # fmt: skip
    reply = httpx2.post(f"{server.url}/v1/responses", json=body, timeout=30,
                        headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert reply.status_code == 200
    assert reply.headers["duet-ignored-fields"] == (
        "service_tier,include.reasoning.encrypted_content"
    )


def _logprobs_of(response: Any) -> list[dict[str, Any]]:
    [message] = response.output
    return [lp.model_dump() for lp in message.content[0].logprobs]


def test_output_text_logprobs_are_chats(client: openai.OpenAI) -> None:
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: the message's tokens'
    logprobs are chat's for the same request, whole and streamed (each delta carrying its
    tokens'), stored, and in a background response; `top_logprobs` alone asks for them too."""
    ask: dict[str, Any] = dict(model=MODEL_NAME, input="Count with me", max_output_tokens=6,
                               temperature=0)  # fmt: skip
    chat = _chat(client, [{"role": "user", "content": "Count with me"}], 6, logprobs=True,
                 top_logprobs=3)  # fmt: skip
    want = [c.model_dump() for c in chat.choices[0].logprobs.content]
    assert len(want) == 6 and all(len(c["top_logprobs"]) == 3 for c in want)
    include = ["message.output_text.logprobs"]
    response = client.responses.create(**ask, include=include, top_logprobs=3)
    assert response.top_logprobs == 3 and _logprobs_of(response) == want
    assert _logprobs_of(client.responses.retrieve(response.id)) == want
    assert _logprobs_of(client.responses.create(**ask, top_logprobs=3, store=False)) == want
    bare = [{**c, "top_logprobs": []} for c in want]
    assert _logprobs_of(client.responses.create(**ask, include=include, store=False)) == bare
    assert _logprobs_of(client.responses.create(**ask, store=False)) == []
    events = list(client.responses.create(**ask, include=include, top_logprobs=3, stream=True,
                                          store=False))  # fmt: skip
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all(e.logprobs for e in deltas)  # each delta carries its tokens (a last one: no text)
    assert [lp.model_dump() for e in deltas for lp in e.logprobs] == want
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.model_dump() for lp in done.logprobs] == want
    assert _logprobs_of(events[-1].response) == want
    queued = client.responses.create(**ask, include=include, top_logprobs=3, background=True)
    ended = wait_for(
        lambda: (r := client.responses.retrieve(queued.id)).status in ("completed", "incomplete")
        and r,
        30, "the background response to finish", 0.05,
    )  # fmt: skip
    assert _logprobs_of(ended) == want


def test_truncation_auto_drops_the_oldest_turns_whole(
    client: openai.OpenAI, rest_engine: AsyncEngine
) -> None:
    turn = "tell me about the weather in the high mountains this week"
    per_pair = 2 * len(rest_engine.engine.tokenizer.encode(turn)) + 8
    messages: list[Any] = []
    for i in range(3 * rest_engine.max_model_len // per_pair):
        messages += [{"role": "user", "content": f"{i} {turn}"},
                     {"role": "assistant", "content": f"{turn} {i}"}]  # fmt: skip
    messages.append({"role": "user", "content": "and now?"})
    ask = dict(model=MODEL_NAME, input=messages, max_output_tokens=8, temperature=0, store=False)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**ask)  # type: ignore[call-overload]
    out = client.responses.create(**ask, truncation="auto")  # type: ignore[call-overload]
    assert out.usage is not None and out.truncation == "auto"
    # The reply is the one to the conversation from some user turn on: the latest start that
    # still fits; one turn earlier does not.
    starts = iter(i for i, m in enumerate(messages) if m["role"] == "user")
    kept = next(starts)
    with pytest.raises(openai.BadRequestError):
        _chat(client, messages[kept:], 8)  # the whole conversation does not fit
    while True:
        kept = next(starts)
        try:
            chat = _chat(client, messages[kept:], 8)  # the first turn from which it fits
            break
        except openai.BadRequestError:
            continue
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.output_text == chat.choices[0].message.content


def test_background_response_completes_and_a_cancelled_one_stays_cancelled(
    client: openai.OpenAI, rest_engine: AsyncEngine
) -> None:
    queued = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4,
                                     temperature=0, background=True)  # fmt: skip
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = wait_for(
        lambda: (r := client.responses.retrieve(queued.id)).status in ("completed", "incomplete")
        and r,
        30, "the background response to finish", 0.05,
    )  # fmt: skip
    plain = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4,
                                    temperature=0, store=False)  # fmt: skip
    assert done.output_text == plain.output_text and done.usage == plain.usage
    assert client.responses.cancel(queued.id).status == done.status  # ended: as it is
    # A long one, cancelled while queued or running, ends cancelled, never completed.
    long = client.responses.create(model=MODEL_NAME, input="Go on", max_output_tokens=1000,
                                   temperature=0, background=True)  # fmt: skip
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.id == long.id
    wait_until_idle(rest_engine, 30)  # its runner stopped generating (or never started)
    assert client.responses.retrieve(long.id).status == "cancelled"
    foreground = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:  # only background ones cancel
        client.responses.cancel(foreground.id)
    assert refused.value.body["param"] == "response_id"


def _in_server(server: LiveServer, coro: Any) -> Any:
    """Run `coro` in the server's event loop (its queue's connections live there)."""
    return asyncio.run_coroutine_threadsafe(coro, server.app.state.loop).result(10)


def _dumps(events: Any) -> list[dict[str, Any]]:
    return [e.model_dump(exclude_unset=True) for e in events]


def test_a_background_response_streams_and_streams_again_from_any_event(
    client: openai.OpenAI, server: LiveServer
) -> None:
    """`background` with `stream`: the typed events of a queued response (created, queued,
    in_progress, the output's, completed), numbered 0, 1, 2, ...; the run goes on when the
    client leaves, and `GET /v1/responses/{id}?stream=true` replays the same events (all, or
    those after `starting_after`), as does the SDK's `responses.stream(response_id=...)`."""
    ask: dict[str, Any] = dict(model=MODEL_NAME, input="Count to twenty", temperature=0,
                               max_output_tokens=16, include=["message.output_text.logprobs"],
                               top_logprobs=2)  # fmt: skip
    plain = client.responses.create(**ask, store=False)
    with client.responses.create(**ask, background=True, stream=True) as stream:
        first = [next(stream) for _ in range(6)]  # then the connection closes
    response_id = first[0].response.id
    assert [e.type for e in first[:4]] == [
        "response.created", "response.queued", "response.in_progress",
        "response.output_item.added",
    ]  # fmt: skip
    assert first[0].response.status == first[1].response.status == "queued"
    # The rest, from where the client left, on reconnecting.
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=5))
    events = _dumps(first) + _dumps(rest)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = client.responses.retrieve(response_id)
    terminal = "response.incomplete" if done.status == "incomplete" else "response.completed"
    assert events[-1] == {"type": terminal, "sequence_number": len(events) - 1,
                          "response": done.model_dump(exclude_unset=True)}  # fmt: skip
    assert done.status == plain.status and done.output_text == plain.output_text
    assert _logprobs_of(done) == _logprobs_of(plain)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in deltas) == plain.output_text
    assert [lp for e in deltas for lp in e["logprobs"]] == _logprobs_of(plain)
    # The whole stream again, and any tail of it; the SDK's helper over it.
    assert _dumps(client.responses.retrieve(response_id, stream=True)) == events
    for after in (0, 2, len(events) - 2):
        tail = client.responses.retrieve(response_id, stream=True, starting_after=after)
        assert _dumps(tail) == events[after + 1 :], after
    with client.responses.stream(response_id=response_id, starting_after=3) as helper:
        seen = list(helper)
    assert [e.sequence_number for e in seen] == list(range(4, len(events)))
    assert seen[-1].response.output_text == plain.output_text  # type: ignore[union-attr]
    # Refused, naming the parameter: a response that did not run in the background (nothing
    # was logged), starting_after below 0.
    headers = {"Authorization": f"Bearer {API_KEY}"}
    foreground = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
    for query, param in (({"stream": "true"}, "stream"),
                         ({"stream": "true", "starting_after": "-1"}, "starting_after")):  # fmt: skip
        target = foreground.id if param == "stream" else response_id
        reply = httpx2.get(f"{server.url}/v1/responses/{target}", params=query, headers=headers,
                           timeout=30)  # fmt: skip
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    # include and include_obfuscation: what a response holds was fixed when it was created.
    # starting_after places a stream only.
    reply = httpx2.get(f"{server.url}/v1/responses/{response_id}", headers=headers, timeout=30,
                       params={"include": "message.output_text.logprobs", "starting_after": 3,
                               "include_obfuscation": "true"})  # fmt: skip
    assert reply.status_code == 200 and reply.json() == done.model_dump(exclude_unset=True)
    assert reply.headers["duet-ignored-fields"] == "include,include_obfuscation,starting_after"


def test_a_background_response_delivered_again_goes_on_from_its_log(
    client: openai.OpenAI, server: LiveServer
) -> None:
    """A delivery that finds steps logged by an earlier one (its router died) renders them and
    generates only the rest: the log here holds the first steps of another prompt's reply, so
    a run that started over would not begin with their text."""
    ask: dict[str, Any] = dict(model=MODEL_NAME, temperature=0, max_output_tokens=12)
    donor = client.responses.create(**ask, input="Name a fruit", background=True)
    ended = ("completed", "incomplete")
    wait_for(lambda: client.responses.retrieve(donor.id).status in ended, 30,
             "the first background response", 0.05)  # fmt: skip
    queue = server.app.state.background_worker.queue
    logged = _in_server(server, queue.read_events(donor.id, 0, 3))
    assert len(logged) == 3
    worker = server.app.state.background_worker
    worker.free_slots = lambda num_running: 0  # hold the next one in the queue
    try:
        held = client.responses.create(**ask, input="Count to twenty", background=True)
        _in_server(server, queue.append_events(held.id, 0, logged))
    finally:
        worker.free_slots = lambda num_running: 4
    done = wait_for(lambda: (r := client.responses.retrieve(held.id)).status in ended and r,
                    30, "the resumed background response", 0.05)  # fmt: skip
    fresh = client.responses.create(**ask, input="Count to twenty", store=False)
    prefix = "".join(json.loads(e)[0]["text"] for e in logged)
    assert (
        prefix and done.output_text.startswith(prefix) and not fresh.output_text.startswith(prefix)
    )
    assert done.usage is not None and done.usage.output_tokens == 12
    events = _dumps(client.responses.retrieve(held.id, stream=True))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == done.output_text
    assert events[-1]["response"] == done.model_dump(exclude_unset=True)


def test_a_waiting_background_stream_sends_keep_alives(
    client: openai.OpenAI, server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a background response waits in the queue its stream sends SSE comments (every
    `KEEPALIVE_S`, here 0.1 s), which the openai client skips."""
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.1)
    worker = server.app.state.background_worker
    worker.free_slots = lambda num_running: 0  # hold it in the queue
    try:
        queued = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=3,
                                         temperature=0, background=True)  # fmt: skip
        seen = []
        with httpx2.stream("GET", f"{server.url}/v1/responses/{queued.id}", timeout=30,
                           params={"stream": "true"},
                           headers={"Authorization": f"Bearer {API_KEY}"}) as reply:  # fmt: skip
            for line in reply.iter_lines():
                seen.append(line)
                if line.startswith(":"):
                    break
        assert [s for s in seen if s.startswith("event: ")] == [
            "event: response.created", "event: response.queued"
        ]  # fmt: skip
        assert seen[-1] == ": keep-alive"
    finally:
        worker.free_slots = lambda num_running: 4
    events = list(client.responses.retrieve(queued.id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete")
