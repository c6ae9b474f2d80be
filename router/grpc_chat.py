"""`duet.v1.ChatRequest` -> the REST chat body, so gRPC chat validates, renders and parses
replies exactly as REST does (tools, tool choice, reasoning, chat-template options;
docs/tool_calling.md), and a chat turn's events (router/chat_events.py) -> `GenerateResponse`s
(`ChatResponses`)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from duet.router.chat_events import (
    ChatStep,
    Finish,
    PromptLogprobs,
    ReasoningDelta,
    TextDelta,
    TokenDelta,
    ToolCallDelta,
    Usage,
)
from duet.router.errors import BadRequestError, format_loc
from duet.router.grpc_logprobs import logprobs_to_proto, prompt_logprobs_to_proto
from duet.router.openai_protocol import ChatCompletionRequest
from duet.router.openai_tools import DeltaToolCall
from duet.v1 import serving_pb2


def _json(field: str, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise BadRequestError(f"{field}: is not JSON: {e}", param=field) from None


def _message(m: serving_pb2.ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    for field in ("tool_call_id", "name", "reasoning_content"):
        if getattr(m, field):
            message[field] = getattr(m, field)
    return message


def chat_body(request: serving_pb2.ChatRequest) -> ChatCompletionRequest:
    """The REST body this request means; `BadRequestError` naming the field."""
    body: dict[str, Any] = {"messages": [_message(m) for m in request.messages]}
    if request.session_id:
        body["session_id"] = request.session_id
    if request.tools:
        body["tools"] = []
        for i, tool in enumerate(request.tools):
            function: dict[str, Any] = {"name": tool.name}
            if tool.description:
                function["description"] = tool.description
            if tool.parameters_json:
                function["parameters"] = _json(f"tools[{i}].parameters_json", tool.parameters_json)
            body["tools"].append({"type": "function", "function": function})
    if request.tool_choice_function:
        if request.tool_choice:
            raise BadRequestError(
                "tool_choice: leave it empty when tool_choice_function is set", "tool_choice"
            )
        body["tool_choice"] = {
            "type": "function",
            "function": {"name": request.tool_choice_function},
        }
    elif request.tool_choice:
        body["tool_choice"] = request.tool_choice
    if request.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = request.parallel_tool_calls
    if request.HasField("add_generation_prompt"):
        body["add_generation_prompt"] = request.add_generation_prompt
    if request.chat_template:
        body["chat_template"] = request.chat_template
    if request.chat_template_kwargs_json:
        body["chat_template_kwargs"] = _json(
            "chat_template_kwargs_json", request.chat_template_kwargs_json
        )
    body["continue_final_message"] = request.continue_final_message
    body["priority"] = request.priority
    if request.sampling.HasField("truncate_prompt_tokens"):
        body["truncate_prompt_tokens"] = request.sampling.truncate_prompt_tokens
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = format_loc(tuple(first["loc"]))
        message = str(first["msg"]).removeprefix("Value error, ")
        raise BadRequestError(f"{param}: {message}", param=param) from None


class ChatResponses:
    """One chat turn's events as `GenerateResponse`s: one per choice per step (its token ids,
    content, thinking, tool-call deltas, logprobs, finish reason; the prompt's logprobs on the
    first), then the usage."""

    def __init__(self, request_id: str, num_prompt_logprobs: int) -> None:
        self.request_id = request_id
        self.num_prompt_logprobs = num_prompt_logprobs
        self._prompt: PromptLogprobs | None = None

    def of(self, step: ChatStep) -> list[serving_pb2.GenerateResponse]:
        prompt = step.first(PromptLogprobs)
        if prompt is not None and prompt.entries is not None:
            self._prompt = prompt  # on the next response out
        out = []
        for index, events in step.by_choice():
            response = serving_pb2.GenerateResponse(request_id=self.request_id, index=index)
            for event in events:
                match event:
                    case TokenDelta(_, token_ids, _, logprobs):
                        response.token_ids.extend(token_ids)
                        response.logprobs.extend(logprobs_to_proto(lp) for lp in logprobs or [])
                    case TextDelta(_, text):
                        response.text += text
                    case ReasoningDelta(_, text):
                        response.reasoning_text += text
                    case ToolCallDelta(_, call):
                        response.tool_calls.append(_tool_call(call))
                    case Finish(_, reason):
                        response.finish_reason = reason
            if self._prompt is not None and self._prompt.entries is not None:
                response.prompt_logprobs.extend(
                    prompt_logprobs_to_proto(self._prompt.entries, self.num_prompt_logprobs)
                )
                self._prompt = None
            out.append(response)
        usage = step.first(Usage)
        if usage is not None:
            out.append(
                serving_pb2.GenerateResponse(
                    request_id=self.request_id,
                    usage=serving_pb2.Usage(
                        prompt_tokens=usage.prompt_tokens,
                        completion_tokens=usage.completion_tokens,
                        cached_prompt_tokens=usage.cached_tokens,
                    ),
                )
            )
        return out


def _tool_call(d: DeltaToolCall) -> serving_pb2.ToolCallDelta:
    return serving_pb2.ToolCallDelta(
        index=d.index,
        id=d.id or "",
        name=(d.function.name if d.function else None) or "",
        arguments=(d.function.arguments if d.function else None) or "",
    )
