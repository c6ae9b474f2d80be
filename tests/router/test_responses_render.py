"""`ResponseRender` on chat-turn events alone: a reply that thinks, answers and calls a tool
becomes a reasoning item, a message and a function call, with the exact event sequence, and
the SDK's types parse every event and the response."""

from __future__ import annotations

from typing import Any

import pydantic
from openai.types.responses import Response, ResponseStreamEvent

from duet.router.chat_events import (
    ChatStep,
    Final,
    Finish,
    ReasoningDelta,
    Reply,
    TextDelta,
    TokenDelta,
    ToolCallDelta,
    Usage,
)
from duet.router.openai_tools import DeltaFunctionCall, DeltaToolCall
from duet.router.responses_protocol import ResponsesRequest
from duet.router.responses_render import ResponseRender, echo_fields

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def _render() -> ResponseRender:
    body = ResponsesRequest.model_validate({"input": "x", "metadata": {"k": "v"}})
    return ResponseRender("resp_1", echo_fields(body, "m", True), lambda text: len(text.split()))


def _steps(finish: str) -> tuple[list[ChatStep], Final]:
    first = DeltaToolCall(
        index=0, id="call_a", type="function", function=DeltaFunctionCall(name="f", arguments="")
    )
    steps = [
        ChatStep([TokenDelta(0, [1], "<think>a"), ReasoningDelta(0, "a b")]),
        ChatStep([TokenDelta(0, [2], "c</think>"), ReasoningDelta(0, " c"), TextDelta(0, "Hi")]),
        ChatStep([TokenDelta(0, [3], "!"), TextDelta(0, "!"), ToolCallDelta(0, first)]),
        ChatStep([ToolCallDelta(0, DeltaToolCall(index=0, function=DeltaFunctionCall(
            arguments='{"x": 1}')))]),
        ChatStep([Finish(0, finish)]),
    ]  # fmt: skip
    reply = Reply(0, "Hi!", "a b c", [], finish)
    return steps, Final([reply], Usage(prompt_tokens=5, completion_tokens=4, cached_tokens=2))


def _run(finish: str) -> tuple[ResponseRender, list[dict[str, Any]]]:
    render = _render()
    steps, final = _steps(finish)
    events = render.opening()
    for step in steps:
        events += render.step(step)
    events += render.closing(final)
    return render, events


def test_reasoning_message_and_call_items_in_order() -> None:
    render, events = _run("tool_calls")
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        EVENTS.validate_python(event)  # every event is one of the SDK's types
    response = Response.model_validate(events[-1]["response"])
    reasoning, message, call = response.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert [c.text for c in reasoning.content] == ["a b c"] and reasoning.summary == []
    assert message.type == "message" and response.output_text == "Hi!"
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments, call.status) == (
        "call_a", "f", '{"x": 1}', "completed",
    )  # fmt: skip
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [
        0, 1, 2,
    ]  # fmt: skip
    usage = response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (5, 4, 9)
    assert usage.input_tokens_details.cached_tokens == 2
    assert usage.output_tokens_details.reasoning_tokens == 3  # the counter's: "a b c"
    assert response.metadata == {"k": "v"} and response.status == "completed"
    assert render.response()["output"] == events[-1]["response"]["output"]


def test_a_reply_cut_by_max_output_tokens_is_incomplete() -> None:
    _, events = _run("length")
    assert events[-1]["type"] == "response.incomplete"
    response = Response.model_validate(events[-1]["response"])
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in response.output] == ["completed", "completed", "incomplete"]
