"""`duet.v1.ChatRequest` -> the REST chat body, so gRPC chat validates, renders and parses
replies exactly as REST does (tools, tool choice, reasoning, chat-template options;
docs/tool_calling.md), and reply pieces -> `GenerateResponse` fields."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from duet.router.errors import BadRequestError, format_loc
from duet.router.openai_protocol import ChatCompletionRequest
from duet.router.tool_stream import Piece
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
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = format_loc(tuple(first["loc"]))
        message = str(first["msg"]).removeprefix("Value error, ")
        raise BadRequestError(f"{param}: {message}", param=param) from None


def piece_fields(piece: Piece) -> dict[str, Any]:
    """A reply piece as `GenerateResponse` fields (text, reasoning_text, tool_calls)."""
    calls = [
        serving_pb2.ToolCallDelta(
            index=d.index,
            id=d.id or "",
            name=(d.function.name if d.function else None) or "",
            arguments=(d.function.arguments if d.function else None) or "",
        )
        for d in piece.tool_calls
    ]
    return {"text": piece.content, "reasoning_text": piece.reasoning, "tool_calls": calls}
