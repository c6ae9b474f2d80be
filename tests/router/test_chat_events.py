"""A chat turn's step in a background request's log (router/chat_events.py): what a stream
renders survives the round trip, and the log tells a takeover where the reply stands."""

from __future__ import annotations

from duet.router.chat_events import (
    ChatStep,
    Finish,
    ReasoningDelta,
    TextDelta,
    TokenDelta,
    ToolCallDelta,
    logged_tokens,
    step_from_json,
    step_to_json,
)
from duet.router.openai_tools import DeltaFunctionCall, DeltaToolCall

CALL = DeltaToolCall(
    index=0, id="call_1", type="function", function=DeltaFunctionCall(name="f", arguments="{")
)


def test_a_step_round_trips():
    step = ChatStep([
        TokenDelta(0, [5, 6], "<think>hi</think>x"), ReasoningDelta(0, "hi"), TextDelta(0, "x"),
        ToolCallDelta(0, CALL), Finish(0, "tool_calls", None),
    ])  # fmt: skip
    assert step_from_json(step_to_json(step)).events == step.events


def test_the_log_says_where_the_reply_stands():
    steps = [ChatStep([TokenDelta(0, [1], "a")]), ChatStep([TokenDelta(0, [2, 3], "bc")])]
    assert logged_tokens(steps) == ([1, 2, 3], "abc", None)
    steps.append(ChatStep([TokenDelta(0, [], ""), Finish(0, "stop", 3)]))
    assert logged_tokens(steps) == ([1, 2, 3], "abc", Finish(0, "stop", 3))
    assert logged_tokens([]) == ([], "", None)
