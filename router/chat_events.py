"""The events of one chat turn (router/chat_turn.py), free of any transport: REST/SSE, gRPC,
the Batch API and background requests render them, and the Responses API can.

`ChatTurn.steps` yields them one engine step at a time (`ChatStep`), each choice's events of
that step together and in this order: `TokenDelta` (what the engine added), then what the
reply's parser made of its text (`ReasoningDelta`, `TextDelta`, `ToolCallDelta`s), then
`Finish` when the choice ended. The prompt's logprobs (`PromptLogprobs`) open the first step
when the request asked; `Usage` and `Final` close the turn, after its session turn is stored.

Background requests log each step (`step_to_json`) and render it again from the log, on any
replica (`step_from_json`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from duet.engine import Logprob, TokenLogprobs
from duet.router.openai_tools import DeltaToolCall, ToolCall


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's logprobs (vLLM's shape: one map per prompt token, None for the first),
    as the request's first output has them."""

    entries: list[dict[int, Logprob] | None] | None


@dataclass(frozen=True)
class TokenDelta:
    """The tokens the engine added to choice `index` in one step, with their logprobs (when
    the request asked) and their text as detokenized, before the reply's parsing (stop
    strings already cut)."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class TextDelta:
    """Reply content of choice `index`."""

    index: int
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """The model's thinking, with a reasoning parser."""

    index: int
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of a tool call: its first piece has the call's id and name, later ones
    append to its arguments."""

    index: int
    call: DeltaToolCall


@dataclass(frozen=True)
class Finish:
    """Choice `index` ended: OpenAI's finish reason (`tool_calls` when the model called
    tools) and, for `stop`, the stop string or token."""

    index: int
    reason: str
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class Reply:
    """One choice's whole reply, as a non-streamed response shows it and a session stores it."""

    index: int
    content: str | None
    """None when the reply is only tool calls, or only thinking (cut before an answer)."""
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class Final:
    """The turn's end: every choice's whole reply, the prompt's logprobs and the usage."""

    replies: list[Reply]
    usage: Usage
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


ChatEvent = (
    PromptLogprobs
    | TokenDelta
    | TextDelta
    | ReasoningDelta
    | ToolCallDelta
    | Finish
    | Usage
    | Final
)


@dataclass
class ChatStep:
    """The events of one engine step (or the turn's closing `Usage` and `Final`)."""

    events: list[ChatEvent] = field(default_factory=list)

    def by_choice(self) -> list[tuple[int, list[ChatEvent]]]:
        """The step's per-choice events, in order (prompt logprobs, usage, final: apart)."""
        groups: dict[int, list[ChatEvent]] = {}
        for event in self.events:
            index = getattr(event, "index", None)
            if index is not None:
                groups.setdefault(index, []).append(event)
        return list(groups.items())

    def first(self, kind: type[Any]) -> Any:
        """The step's first event of `kind`, or None."""
        return next((e for e in self.events if isinstance(e, kind)), None)


# -- the background log's form of a step (choice deltas, with their tokens' logprobs when the
# request asked: what a stream renders) ---------------------------------------------------


def step_to_json(step: ChatStep) -> str:
    out: list[dict[str, Any]] = []
    for event in step.events:
        match event:
            case TokenDelta(index, token_ids, text, logprobs):
                entry: dict[str, Any] = {"kind": "tokens", "index": index, "ids": token_ids,
                                         "text": text}  # fmt: skip
                if logprobs:
                    entry["logprobs"] = [_logprobs_to_json(t) for t in logprobs]
                out.append(entry)
            case TextDelta(index, text):
                out.append({"kind": "text", "index": index, "text": text})
            case ReasoningDelta(index, text):
                out.append({"kind": "reasoning", "index": index, "text": text})
            case ToolCallDelta(index, call):
                out.append({"kind": "tool_call", "index": index, "call": call.model_dump()})
            case Finish(index, reason, stop_reason):
                out.append({"kind": "finish", "index": index, "reason": reason,
                            "stop_reason": stop_reason})  # fmt: skip
    return json.dumps(out)


def step_from_json(text: str) -> ChatStep:
    events: list[ChatEvent] = []
    for item in json.loads(text):
        kind, index = item["kind"], item["index"]
        if kind == "tokens":
            logprobs = item.get("logprobs")
            events.append(TokenDelta(
                index, item["ids"], item["text"],
                None if logprobs is None else [_logprobs_from_json(t) for t in logprobs],
            ))  # fmt: skip
        elif kind == "text":
            events.append(TextDelta(index, item["text"]))
        elif kind == "reasoning":
            events.append(ReasoningDelta(index, item["text"]))
        elif kind == "tool_call":
            events.append(ToolCallDelta(index, DeltaToolCall.model_validate(item["call"])))
        elif kind == "finish":
            events.append(Finish(index, item["reason"], item["stop_reason"]))
    return ChatStep(events)


def _logprob_to_json(p: Logprob) -> list[Any]:
    return [p.token_id, p.logprob, p.token, p.rank]


def _logprobs_to_json(t: TokenLogprobs) -> list[Any]:
    return [_logprob_to_json(t.sampled), [_logprob_to_json(p) for p in t.top]]


def _logprobs_from_json(item: list[Any]) -> TokenLogprobs:
    sampled, top = item
    return TokenLogprobs(Logprob(*sampled), [Logprob(*p) for p in top])


def logged_tokens(steps: Sequence[ChatStep]) -> tuple[list[int], str, Finish | None]:
    """Choice 0's token ids and raw text in logged steps, and its `Finish` if it ended."""
    ids: list[int] = []
    text, finish = "", None
    for step in steps:
        for event in step.events:
            if isinstance(event, TokenDelta) and event.index == 0:
                ids += event.token_ids
                text += event.text
            elif isinstance(event, Finish) and event.index == 0:
                finish = event
    return ids, text, finish
