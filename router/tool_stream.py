"""One reply's text -> content and OpenAI tool-call deltas, as the text streams in
(docs/tool_calling.md). A full (non-streamed) reply is the same deltas merged (`collect`), so a
streamed and an unstreamed reply always agree.

- `NamedCallStream`: the whole reply is the named function's arguments (the grammar made it so).
- `RequiredCallsStream`: the reply is the grammar's `[{"name": ..., "parameters": {...}}, ...]`;
  each call's header goes out once its name is complete, then its arguments as they come.
- `ParsedCallsStream`: `tool_choice: "auto"`; content streams until a tool-call marker of the
  model's format, the calls go out as the parser completes them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from duet.router.openai_tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    ToolPlan,
)
from duet.router.tool_parsers import ParsedCall, ToolCallParser


@dataclass
class Piece:
    """What one step of the text adds: content and tool-call deltas."""

    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)
    reasoning: str = ""

    def then(self, other: Piece) -> Piece:
        """This piece followed by `other`."""
        return Piece(
            self.content + other.content,
            self.tool_calls + other.tool_calls,
            self.reasoning + other.reasoning,
        )

    @property
    def is_empty(self) -> bool:
        return not (self.content or self.tool_calls or self.reasoning)


class ToolCallStream:
    def __init__(self, new_id: Callable[[], str]) -> None:
        self._new_id = new_id
        self.num_calls = 0

    def feed(self, text: str) -> Piece:
        raise NotImplementedError

    def finish(self) -> Piece:
        """Whatever is still held back, at the end of the reply."""
        return Piece()

    def _header(self, name: str, arguments: str = "") -> DeltaToolCall:
        self.num_calls += 1
        return DeltaToolCall(
            index=self.num_calls - 1,
            id=self._new_id(),
            type="function",
            function=DeltaFunctionCall(name=name, arguments=arguments),
        )

    def _arguments(self, text: str) -> DeltaToolCall:
        return DeltaToolCall(index=self.num_calls - 1, function=DeltaFunctionCall(arguments=text))


class NamedCallStream(ToolCallStream):
    def __init__(self, name: str, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._name = name

    def feed(self, text: str) -> Piece:
        if self.num_calls == 0:
            return Piece(tool_calls=[self._header(self._name, text)])
        return Piece(tool_calls=[self._arguments(text)] if text else [])


# One call's opening in the `required` grammar's array, up to its arguments.
_CALL_HEAD = re.compile(
    r'\s*[\[,]\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*'
)
_CALL_END = re.compile(r"\s*\}")


class _ValueEnd:
    """Finds where one JSON value that starts at `i` ends, in text that grows."""

    def __init__(self, i: int) -> None:
        self.i = i
        self.start: int | None = None
        """Where the value starts (past any whitespace), once seen."""
        self.kind = ""
        self.depth = 0
        self.in_string = False
        self.escape = False

    def advance(self, text: str) -> int | None:
        """The index just past the value, or None while it is unfinished."""
        while self.i < len(text):
            ch = text[self.i]
            if not self.kind:
                if ch in " \t\r\n":
                    self.i += 1
                    continue
                self.start = self.i
                self.kind = "nest" if ch in "{[" else "string" if ch == '"' else "scalar"
                if self.kind == "string":
                    self.in_string = True
                    self.i += 1
                    continue
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.kind == "string":
                        self.i += 1
                        return self.i
                self.i += 1
                continue
            if self.kind == "scalar":
                if ch in ",}] \t\r\n":
                    return self.i
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.i += 1
                    return self.i
            self.i += 1
        return None


class RequiredCallsStream(ToolCallStream):
    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._text = ""
        self._pos = 0  # where the next call (or the array's end) starts
        self._value: _ValueEnd | None = None  # the current call's arguments, once its head is in
        self._sent = 0  # how far the current call's arguments went out
        self._value_end: int | None = None

    def feed(self, text: str) -> Piece:
        self._text += text
        piece = Piece()
        while True:
            if self._value is None:
                head = _CALL_HEAD.match(self._text, self._pos)
                if head is None:
                    return piece
                piece.tool_calls.append(self._header(json.loads(head.group(1))))
                self._value = _ValueEnd(head.end())
                self._sent = head.end()
                self._value_end = None
            if self._value_end is None:
                self._value_end = self._value.advance(self._text)
                end = len(self._text) if self._value_end is None else self._value_end
                if self._value.start is None:
                    return piece
                self._sent = max(self._sent, self._value.start)
                if end > self._sent:
                    piece.tool_calls.append(self._arguments(self._text[self._sent : end]))
                    self._sent = end
                if self._value_end is None:
                    return piece
            close = _CALL_END.match(self._text, self._value_end)
            if close is None:
                return piece
            self._pos = close.end()
            self._value = None


class ParsedCallsStream(ToolCallStream):
    def __init__(self, parser: ToolCallParser, parallel: bool, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._parser = parser
        self._parallel = parallel
        self._pending = ""  # content held back: it may start a marker
        self._at_start = True
        self._calls: list[str] | None = None  # the text from where tool calls start, in pieces
        self._tail: list[str] = []  # the part of it after the calls parsed so far
        self._window = ""  # the tail's end, where an end marker may have begun
        self._num_parsed = 0
        self.num_scanned_chars = 0
        """Characters looked at for end markers (each a bounded number of times: streaming a
        long call is linear in its length, not quadratic)."""

    def feed(self, text: str) -> Piece:
        if self._calls is not None:
            return Piece(tool_calls=self._complete(text))
        self._pending += text
        start = self._parser.find_start(self._pending, self._at_start)
        if start is not None:
            content, calls_text = self._pending[:start], self._pending[start:]
            self._pending = ""
            self._calls = []
            return Piece(content=content, tool_calls=self._complete(calls_text))
        keep = self._parser.held_back(self._pending, self._at_start)
        content = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(content) :]
        if content:
            self._at_start = False
        return Piece(content=content)

    def finish(self) -> Piece:
        if self._calls is None:
            content, self._pending = self._pending, ""
            return Piece(content=content)
        calls_text = "".join(self._calls)
        calls = self._parser.final_calls(calls_text)
        if calls is None:
            if self.num_calls:
                return Piece()  # what follows the calls that parsed is dropped
            return Piece(content=calls_text)  # nothing parsed: it was content after all
        return Piece(tool_calls=self._emit(calls[self._num_parsed :]))

    def _complete(self, text: str) -> list[DeltaToolCall]:
        """Calls that `text` completes. Only the text since the last parsed call is parsed,
        and only once an end marker shows up in the new text (or across its start)."""
        assert self._calls is not None
        self._calls.append(text)
        end = self._parser.end_marker
        if end is None or not text:
            return []
        self._tail.append(text)
        window = self._window + text
        self.num_scanned_chars += len(window)
        self._window = window[len(window) - len(end) + 1 :]
        if end not in window:
            return []
        tail = "".join(self._tail)
        calls, used = self._parser.complete_calls(tail)
        rest = tail[used:]
        self._tail = [rest]
        self._window = rest[max(0, len(rest) - len(end) + 1) :]
        self._num_parsed += len(calls)
        return self._emit(calls)

    def _emit(self, calls: list[ParsedCall]) -> list[DeltaToolCall]:
        if not self._parallel:
            calls = calls[: max(0, 1 - self.num_calls)]
        return [self._header(name, arguments) for name, arguments in calls]


def stream_for(plan: ToolPlan, parser: ToolCallParser | None) -> ToolCallStream | None:
    """The stream for a request's plan; None when replies are plain content."""
    if plan.mode == "named":
        assert plan.named is not None
        return NamedCallStream(plan.named, plan.new_id)
    if plan.mode == "required":
        return RequiredCallsStream(plan.new_id)
    if plan.mode == "auto" and parser is not None:
        return ParsedCallsStream(parser, plan.parallel, plan.new_id)
    return None


def collect(pieces: list[Piece]) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content and tool calls from its pieces. Content is None when the reply
    is only tool calls (as OpenAI answers)."""
    content = "".join(p.content for p in pieces)
    calls: list[ToolCall] = []
    for piece in pieces:
        for delta in piece.tool_calls:
            fn = delta.function or DeltaFunctionCall()
            if delta.id is not None:
                name = fn.name or ""
                calls.append(ToolCall(id=delta.id, function=FunctionCall(name=name, arguments="")))
            calls[delta.index].function.arguments += fn.arguments or ""
    if calls and not content.strip():
        return None, calls
    return content, calls
