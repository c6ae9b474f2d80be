"""A chat turn's events (router/chat_events.py) as the Responses API's objects: the streamed
event sequence and the whole response, both from one `ResponseRender`, so a streamed response
and the one stored or fetched later have the same output items and ids.

Output items open as their first delta arrives and close when another kind starts or the turn
ends: reasoning (`reasoning_text` content), the assistant message (`output_text` content), one
`function_call` per tool call. Each event carries the response-wide `sequence_number`:

    response.created, response.in_progress,
    per item: response.output_item.added, then
      message:       response.content_part.added, response.output_text.delta*,
                     response.output_text.done, response.content_part.done
      reasoning:     response.content_part.added, response.reasoning_text.delta*,
                     response.reasoning_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta*,
                     response.function_call_arguments.done
    response.output_item.done, and last response.completed (or response.incomplete when
    max_output_tokens cut the reply).
"""

from __future__ import annotations

import copy
import hashlib
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from duet.engine import TokenLogprobs
from duet.router.chat_events import (
    ChatStep,
    Final,
    Finish,
    ReasoningDelta,
    TextDelta,
    TokenDelta,
    ToolCallDelta,
)
from duet.router.logprobs import response_logprobs
from duet.router.responses_protocol import NamedFunctionChoice, ResponsesRequest

_STATUS = {"length": "incomplete", "abort": "cancelled"}
"""A reply's finish reason -> the response's status (else completed)."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def echo_fields(body: ResponsesRequest, model: str, stored: bool) -> dict[str, Any]:
    """What a response repeats of its request (OpenAI's response object fields)."""
    choice: Any = body.tool_choice or "auto"
    if isinstance(choice, NamedFunctionChoice):
        choice = choice.model_dump()
    fmt = body.text.format if body.text is not None and body.text.format else None
    text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}
    reasoning = body.reasoning.model_dump(exclude_none=True) if body.reasoning else None
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "model": model,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": reasoning,
        "store": stored,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": text,
        "tool_choice": choice,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled",
        "top_logprobs": body.top_logprobs,
        "conversation": {"id": body.conversation_id} if body.conversation_id else None,
        "user": body.user,
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
        "max_tool_calls": body.max_tool_calls,
        "background": body.background,
    }


LogprobsRender = Callable[[Sequence[TokenLogprobs]], list[dict[str, Any]]]
"""Engine logprobs -> the `output_text` logprob objects (router/logprobs.response_logprobs)."""


class ResponseRender:
    """One response's objects and events (see the module's docstring).

    With `logprobs`, each reply token's logprobs go with the message text its step shows
    (chat's logprobs, less the tokens of reasoning and tool calls): a step's tokens wait for
    the next text (a held-back stop-string candidate or part of a character shows a step
    later) and go with it when it is the message's, and are dropped when it is reasoning or a
    tool call; tokens whose text never showed (a stop string, a character left incomplete)
    close the message in a delta of no text."""

    def __init__(
        self,
        response_id: str,
        echo: dict[str, Any],
        count_tokens: Callable[[str], int],
        created_at: int | None = None,
        logprobs: LogprobsRender | None = None,
    ) -> None:
        self.response_id = response_id
        self.echo = echo
        self.created_at = int(time.time()) if created_at is None else created_at
        self.count_tokens = count_tokens
        self.logprobs = logprobs
        self._pending_logprobs: list[dict[str, Any]] = []
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.status = "in_progress"
        self._sequence_number = 0
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # the reply's call index -> its item
        self._reasoning = ""
        self._ids_made = 0

    @classmethod
    def resumed(
        cls,
        response: dict[str, Any],
        count_tokens: Callable[[str], int],
        logprobs: LogprobsRender | None = None,
    ) -> ResponseRender:
        """The render of a stored (queued) response, run later by a queue worker."""
        echo = {k: v for k, v in response.items() if k not in _OWN_FIELDS}
        return cls(response["id"], echo, count_tokens, response["created_at"], logprobs)

    def error_event(self, code: str, message: str, param: str | None) -> dict[str, Any]:
        """The `error` event that ends a stream that failed."""
        return self._event("error", code=code, message=message, param=param)

    def response(
        self, status: str | None = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The response object as it stands."""
        status = status or self.status
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            **self.echo,
            "output": copy.deepcopy(self.output),
            "usage": self.usage,
            "completed_at": int(time.time()) if status == "completed" else None,
        }

    def opening(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def queued_opening(self) -> list[dict[str, Any]]:
        """A background response's first events (`started` follows once a worker runs it)."""
        queued = self.response("queued")
        return [
            self._event("response.created", response=queued),
            self._event("response.queued", response=copy.deepcopy(queued)),
        ]

    def started(self) -> dict[str, Any]:
        return self._event("response.in_progress", response=self.response("in_progress"))

    def ended(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        """A replayed background response's end: what is still open closes, then the terminal
        event carrying `response` as stored (the stream's and the store's object are one)."""
        events = self._close()
        events.append(self._event(_terminal(response["status"]), response=response))
        return events

    def step(self, step: ChatStep) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for event in step.events:
            if getattr(event, "index", 0) != 0:
                continue  # a response has one reply
            match event:
                case TokenDelta(_, _, _, logprobs) if self.logprobs is not None and logprobs:
                    self._pending_logprobs += self.logprobs(logprobs)
                case ReasoningDelta(_, text) if text:
                    events += self._delta("reasoning", text)
                case TextDelta(_, text) if text:
                    events += self._delta("message", text)
                case ToolCallDelta(_, call):
                    events += self._call_delta(call.index, call.id, call.function)
                case Finish(_, reason):
                    self.status = _STATUS.get(reason, "completed")
                    events += self._close()
        return events

    def closing(self, final: Final) -> list[dict[str, Any]]:
        """The turn ended: whatever is still open closes, then the terminal event."""
        events = self._close()
        u = final.usage
        reasoning_tokens = self.count_tokens(self._reasoning) if self._reasoning else 0
        self.usage = {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        }
        if self.status == "in_progress":  # no Finish: the engine aborted it
            self.status = "cancelled"
        events.append(self._event(_terminal(self.status), response=self.response()))
        return events

    # --- items ---

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event

    def _new_id(self, prefix: str) -> str:
        """An output item's id, the same on every render of the same steps (a background
        response's stream is rendered again from its log, on any replica)."""
        self._ids_made += 1
        digest = hashlib.sha256(f"{self.response_id}/{self._ids_made}".encode()).hexdigest()
        return f"{prefix}_{digest[:32]}"

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1}

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open = item
        events = [
            self._event("response.output_item.added", output_index=len(self.output) - 1,
                        item=copy.deepcopy(item))
        ]  # fmt: skip
        if item["type"] in ("message", "reasoning"):
            part = _part(item["type"], "")
            item["content"].append(part)
            events.append(
                self._event("response.content_part.added", **self._where(), content_index=0,
                            part=copy.deepcopy(part))
            )  # fmt: skip
        return events

    def _delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        logprobs, self._pending_logprobs = self._pending_logprobs, []  # this text's tokens'
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            item_id = self._new_id("msg" if kind == "message" else "rs")
            item: dict[str, Any] = {"id": item_id, "type": kind, "status": "in_progress",
                                    "content": []}  # fmt: skip
            if kind == "message":
                item["role"] = "assistant"
            else:
                item["summary"] = []
            events += self._add(item)
        assert self._open is not None
        part = self._open["content"][0]
        part["text"] += text
        if kind == "message":
            part["logprobs"] += logprobs
            events.append(
                self._event("response.output_text.delta", **self._where(), content_index=0,
                            delta=text, logprobs=copy.deepcopy(logprobs))
            )  # fmt: skip
        else:
            self._reasoning += text
            events.append(
                self._event("response.reasoning_text.delta", **self._where(), content_index=0,
                            delta=text)
            )  # fmt: skip
        return events

    def _call_delta(self, index: int, call_id: str | None, function: Any) -> list[dict[str, Any]]:
        events = []
        self._pending_logprobs = []  # a tool call's tokens: not the message's text
        item = self._calls.get(index)
        if item is None:
            events += self._close()
            item = {
                "id": self._new_id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": call_id or self._new_id("call"),
                "name": (function.name if function is not None else None) or "", "arguments": "",
            }  # fmt: skip
            self._calls[index] = item
            events += self._add(item)
        arguments = function.arguments if function is not None else None
        if arguments:
            item["arguments"] += arguments
            events.append(
                self._event("response.function_call_arguments.delta", **self._where(),
                            delta=arguments)
            )  # fmt: skip
        return events

    def _close(self) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        where = self._where()
        item["status"] = "incomplete" if self.status == "incomplete" else "completed"
        events = []
        if item["type"] == "function_call":
            events.append(
                self._event("response.function_call_arguments.done", **where,
                            name=item["name"], arguments=item["arguments"])
            )  # fmt: skip
        else:
            part = item["content"][0]
            if item["type"] == "message" and self._pending_logprobs:
                # the reply's last tokens, whose text never showed (an incomplete character,
                # a stop string): chat lists them too
                logprobs, self._pending_logprobs = self._pending_logprobs, []
                part["logprobs"] += logprobs
                events.append(
                    self._event("response.output_text.delta", **where, content_index=0,
                                delta="", logprobs=copy.deepcopy(logprobs))
                )  # fmt: skip
            if item["type"] == "message":
                events.append(
                    self._event("response.output_text.done", **where, content_index=0,
                                text=part["text"], logprobs=copy.deepcopy(part["logprobs"]))
                )  # fmt: skip
            else:
                events.append(
                    self._event("response.reasoning_text.done", **where, content_index=0,
                                text=part["text"])
                )  # fmt: skip
            events.append(
                self._event("response.content_part.done", **where, content_index=0,
                            part=copy.deepcopy(part))
            )  # fmt: skip
        events.append(
            self._event("response.output_item.done", output_index=where["output_index"],
                        item=copy.deepcopy(item))
        )  # fmt: skip
        self._open = None
        return events


_OWN_FIELDS = frozenset(
    {"id", "object", "created_at", "status", "error", "incomplete_details", "output", "usage",
     "completed_at"}
)  # fmt: skip


def _terminal(status: str) -> str:
    """The event that ends a response of `status` (a cancelled one ends as completed: OpenAI
    names no event for it; the response's status says it)."""
    return {"incomplete": "response.incomplete", "failed": "response.failed"}.get(
        status, "response.completed"
    )


def logprobs_render(chat: Any, texts: Any) -> LogprobsRender | None:
    """How a response whose turn runs as `chat` (a ChatCompletionRequest) renders its
    logprobs, with the server's `TokenTexts`; None when it asked for none."""
    if not chat.logprobs:
        return None
    top = chat.top_logprobs or 0
    return lambda entries: response_logprobs(entries, top, texts)


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    """How many tokens a text is (the reasoning tokens of a reply's usage)."""
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}
