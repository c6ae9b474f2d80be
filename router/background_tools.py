"""Tools in background chat requests (router/background.py): the request's raw text, logged
token by token, becomes OpenAI tool calls the same way on every replica and every takeover.

The tool fields (and how the reply starts, for a reasoning parser) are stored with the request,
so the runner, the result and the events route rebuild one `ChatPlan`; its tool-call ids derive
from the request id, so a re-run, the stored session turn and every reconnecting events stream
name each call alike."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from typing import Any

from duet.engine.tokenizer import Tokenizer
from duet.router.openai_chat import ChatOptions, ChatPlan, ReplyStream
from duet.router.openai_protocol import ChatCompletionRequest
from duet.router.openai_responses import DeltaMessage

_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


def tool_fields(body: ChatCompletionRequest, options: ChatOptions) -> dict[str, Any] | None:
    """What a background request stores to rebuild its chat plan: its tool fields, none
    (`{}`) for a plain request on a server with a reasoning parser (the thinking still goes
    to `reasoning_content`), or None: the reply is plain text."""
    if not body.tools or body.tool_choice == "none":
        return {} if options.reasoning_parser is not None else None
    return body.model_dump(mode="json", include=set(_FIELDS), exclude_none=True)


def stable_call_ids(request_id: str, mistral: bool) -> Callable[[], str]:
    """Tool-call ids that are the same on every rebuild of the request's plan (Mistral's
    templates need 9 letters or digits)."""
    counter = itertools.count()

    def new_id() -> str:
        digest = hashlib.sha256(f"{request_id}:{next(counter)}".encode()).hexdigest()
        return digest[:9] if mistral else f"call_{digest[:24]}"

    return new_id


def rebuild_plan(
    fields: dict[str, Any],
    reply_start: Any,
    options: ChatOptions,
    tokenizer: Tokenizer,
    request_id: str,
) -> ChatPlan:
    """The stored request's plan (its fields were validated when it was submitted)."""
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": ""}], **fields}
    )
    plan = ChatPlan.of(body, options, tokenizer)
    plan.tools.new_id = stable_call_ids(request_id, plan.parser.name == "mistral")
    plan.reply_start = reply_start
    return plan


def replay(reply: ReplyStream, events: list[dict[str, Any]]) -> None:
    """Feed the logged events a reconnecting stream already sent (their pieces are dropped)."""
    for event in events:
        reply.feed(event["text"])
        if event["finish_reason"] is not None:
            reply.finish()


def event_delta(reply: ReplyStream, event: dict[str, Any]) -> tuple[DeltaMessage, str | None]:
    """One logged event as a chunk's delta and finish reason."""
    piece = reply.feed(event["text"])
    finish = event["finish_reason"]
    if finish is not None:
        piece = piece.then(reply.finish())
        finish = reply.finish_reason(finish)
    delta = DeltaMessage(
        content=piece.content or None,
        reasoning_content=piece.reasoning or None,
        tool_calls=piece.tool_calls or None,
    )
    return delta, finish
